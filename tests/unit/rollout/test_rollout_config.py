"""The engine section nested in the rollout config: every engine setting reachable from a run config
by its dotted key, refusals that name the key, and the run's own values filled in per engine."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, load_config
from miles.rollout.config import RolloutConfig


def test_every_engine_setting_is_a_dotted_key_of_the_rollout_section():
    cfg = load_config(RolloutConfig, None, {"engine.dtype": "bfloat16", "engine.max_batch_size": "4",
                                            "engine.num_threads": "2", "engine.prefix_cache": "false",
                                            "engine.context_length": "512"})
    e = cfg.engine
    assert (e.dtype, e.max_batch_size, e.num_threads, e.prefix_cache, e.context_length) == \
        ("bfloat16", 4, 2, False, 512)


def test_old_flat_engine_keys_are_refused_naming_the_valid_ones():
    with pytest.raises(ConfigError, match="engine_dtype.*valid keys.*engine"):
        load_config(RolloutConfig, None, {"engine_dtype": "bfloat16"})


def test_engine_dtype_refusal_names_the_key():
    with pytest.raises(ConfigError, match="rollout.engine.dtype"):
        load_config(RolloutConfig, None, {"engine.dtype": "int8"})


def test_an_engine_of_the_run_gets_the_model_seed_and_token_of_the_run():
    cfg = load_config(RolloutConfig, None, {"engine.dtype": "bfloat16", "engine.prefix_block_size": "4"})
    e = cfg.engine.for_run("/models/tiny", seed=7, admin_token="t")
    assert (e.model_path, e.seed, e.admin_token, e.dtype, e.prefix_block_size) == ("/models/tiny", 7, "t", "bfloat16", 4)
    assert type(e).__name__ == "EngineConfig"  # what the engine process is given, not the run's section
