"""Schedule and placement refusals, and how cores are split per placement."""

import pytest

from miles.config import ConfigError


def load(model_dir, **over):
    from miles.config import load_config
    from miles.run_config import RunConfig

    return load_config(RunConfig, None, {"model.path": model_dir, **over})


@pytest.mark.parametrize("schedule", ["one_step_off", "fully_async"])
def test_overlapped_schedules_refuse_the_colocated_placement(tiny_model_dir, schedule):
    with pytest.raises(ConfigError, match="set placement.mode = 'disaggregated' or loop.schedule = 'sync'"):
        load(tiny_model_dir, **{"loop.schedule": schedule, "placement.mode": "colocated"})


def test_sync_runs_colocated_and_overlapped_schedules_run_disaggregated(tiny_model_dir):
    assert load(tiny_model_dir, **{"placement.mode": "colocated"}).placement.mode == "colocated"
    for schedule in ("one_step_off", "fully_async"):
        assert load(tiny_model_dir, **{"loop.schedule": schedule}).loop.schedule == schedule


def test_staleness_bound_below_what_the_schedule_produces_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="set buffer.max_staleness >= 1"):
        load(tiny_model_dir, **{"loop.schedule": "one_step_off", "buffer.max_staleness": "0"})
    with pytest.raises(ConfigError, match="set buffer.max_staleness >= 2"):
        load(tiny_model_dir, **{"loop.update_weights_interval": "3", "buffer.max_staleness": "1"})


def test_buffer_too_small_for_a_synchronous_batch_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="buffer.capacity >= rollout.prompts_per_step"):
        load(tiny_model_dir, **{"buffer.capacity": "4", "rollout.prompts_per_step": "8"})


def test_unknown_schedule_lists_the_choices(tiny_model_dir):
    with pytest.raises(ConfigError, match="'fully_async'"):
        load(tiny_model_dir, **{"loop.schedule": "async"})


def test_core_pools_are_disjoint_when_disaggregated_and_shared_when_colocated(monkeypatch):
    import os

    from miles.orchestration.placement import core_pools
    from miles.run_sections import PlacementConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    split = core_pools(PlacementConfig())
    assert set(split.engine).isdisjoint(split.trainer) and set(split.engine) | set(split.trainer) == {0, 1, 2, 3}
    shared = core_pools(PlacementConfig(mode="colocated"))
    assert shared.engine == shared.trainer == (0, 1, 2, 3)
