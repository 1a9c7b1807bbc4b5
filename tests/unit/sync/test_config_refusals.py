"""Weight-sync settings that cannot work are refused when the config loads, with the fix named."""

from __future__ import annotations

import pytest

from miles.config import ConfigError
from miles.config.loader import load_config
from miles.run_config import RunConfig


def _load(model_dir: str, **overrides: str) -> RunConfig:
    return load_config(RunConfig, None, {"model.path": model_dir, **overrides})


def test_disk_delta_loads_with_a_delta_dir(tiny_model_dir, tmp_path):
    cfg = _load(tiny_model_dir, **{"sync.transport": "disk_delta", "sync.delta_dir": str(tmp_path)})
    assert cfg.sync.transport == "disk_delta" and cfg.sync.verify_first_update


@pytest.mark.parametrize("overrides, fix", [
    ({"placement.mode": "colocated"}, "placement.mode = 'disaggregated'"),
    ({"trainer.lora.rank": "8"}, "trainer.lora.rank = 0"),
    ({}, "sync.delta_dir"),
    ({"rollout.engine_urls": "http://10.0.0.5:30000", "rollout.pd_disaggregation": "true"},
     "sync.transport = 'broadcast' or 'p2p'"),
], ids=["colocated", "lora", "no-delta-dir", "pd-disaggregation"])
def test_disk_delta_refusals_name_the_fix(tiny_model_dir, tmp_path, overrides, fix):
    base = {"sync.transport": "disk_delta"}
    if fix != "sync.delta_dir":
        base["sync.delta_dir"] = str(tmp_path)
    with pytest.raises(ConfigError) as err:
        _load(tiny_model_dir, **base, **overrides)
    assert fix in str(err.value)


def test_unknown_transport_lists_the_choices(tiny_model_dir):
    with pytest.raises(ConfigError, match="p2p"):
        _load(tiny_model_dir, **{"sync.transport": "pigeon"})


def test_pd_disaggregation_needs_external_engines(tiny_model_dir):
    with pytest.raises(ConfigError, match="rollout.engine_urls"):
        _load(tiny_model_dir, **{"rollout.pd_disaggregation": "true"})
    cfg = _load(tiny_model_dir, **{"rollout.engine_urls": "http://10.0.0.5:30000,http://10.0.0.6:30000",
                                   "rollout.pd_disaggregation": "true"})
    assert cfg.rollout.engine_urls == ["http://10.0.0.5:30000", "http://10.0.0.6:30000"]


def test_engine_urls_must_be_urls(tiny_model_dir):
    with pytest.raises(ConfigError, match="http"):
        _load(tiny_model_dir, **{"rollout.engine_urls": "10.0.0.5:30000"})


def test_weights_ship_in_the_engines_dtype_unless_told(tiny_model_dir):
    bf16 = _load(tiny_model_dir, **{"rollout.engine.dtype": "bfloat16"})
    assert bf16.wire_dtype() == "bfloat16" and bf16.sync.dtype is None  # derived, never written into the config
    assert _load(tiny_model_dir).wire_dtype() is None  # fp32 engines: the trainer's fp32 as it is
    cfg = _load(tiny_model_dir, **{"rollout.engine.dtype": "bfloat16", "sync.dtype": "float16"})
    assert cfg.wire_dtype() == "float16"


def test_push_deadlines_retries_and_fallback_load_and_refuse_what_cannot_work(tiny_model_dir):
    cfg = load_config(RunConfig, None, {"model.path": tiny_model_dir, "sync.fallback": ["broadcast", "disk"],
                                        "sync.retries": 2, "sync.version_timeout_s": 300.0})
    assert cfg.sync.fallback == ["broadcast", "disk"] and cfg.sync.retries == 2
    for overrides, fix in (({"sync.version_timeout_s": 5.0}, "sync.version_timeout_s"),
                           ({"sync.retries": -1}, "sync.retries"),
                           ({"sync.fallback": ["pigeon"]}, "pigeon")):
        with pytest.raises(ConfigError, match=fix):
            load_config(RunConfig, None, {"model.path": tiny_model_dir, **overrides})
