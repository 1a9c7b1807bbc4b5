"""A transport a user writes outside miles (`module:Class` in the run config) is picked up by the
config loader (its own Config, its own keys) and by the trainer's updater, and delivers a version
into a real built-in engine's staging and commits it. The transport is the one docs/extending.md
shows, loaded from the page."""

from __future__ import annotations

import pytest
import torch

from miles.config import ConfigError
from miles.config.loader import load_config
from miles.run_config import RunConfig
from miles.sync.transports import TRANSPORTS
from miles.sync.updater import WeightUpdater
from tests.helpers.docs_examples import importable_examples

SPEC = "my_transports:ShmFileTransport"


@pytest.fixture(autouse=True)
def docs_examples(tmp_path):
    with importable_examples("extending.md", tmp_path):
        yield


def test_a_user_transport_from_the_run_config_delivers_and_commits(engine_thread, base_model_dir, admin_token):
    cfg = load_config(RunConfig, None, {"model.path": base_model_dir, "sync.transport": SPEC,
                                        "sync.file_tag": "usertest", "sync.bucket_size_mb": "1"})
    transport_cls = TRANSPORTS.get(cfg.sync.transport)
    assert type(cfg.sync) is transport_cls.Config and cfg.sync.file_tag == "usertest"

    engine = engine_thread.engine
    g = torch.Generator().manual_seed(7)
    state = {n: t + 0.01 * torch.randn(t.shape, generator=g)
             for n, t in engine.model.state_dict().items() if n != "lm_head.weight"}  # lm_head is tied
    updater = WeightUpdater(cfg.sync, admin_token, base_model_dir)
    assert isinstance(updater.transport, transport_cls)
    updater.connect([engine_thread.url])
    try:
        metrics = updater.push(iter({n: t.clone() for n, t in state.items()}.items()), version=77)
    finally:
        updater.close()
    assert metrics["sync/buckets"] >= 2 and metrics["sync/verified_tensors"] == len(state)
    assert engine.weight_version == "77"
    served = engine.model.state_dict()
    assert all(torch.equal(served[n], t) for n, t in state.items())
    assert updater.transport.written and all("usertest" in p for p in updater.transport.written)


def test_a_user_transport_keeps_other_transports_keys_out(base_model_dir):
    with pytest.raises(ConfigError, match="sync.delta_dir"):
        load_config(RunConfig, None, {"model.path": base_model_dir, "sync.transport": SPEC, "sync.delta_dir": "/x"})


def test_a_class_that_is_not_a_transport_is_refused_naming_what_it_lacks(base_model_dir):
    with pytest.raises(ConfigError, match="send_bucket"):
        load_config(RunConfig, None, {"model.path": base_model_dir,
                                      "sync.transport": "my_transports:ShmFileConfig"})
