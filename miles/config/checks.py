"""Checks across config sections: combinations of individually valid settings that cannot run.

Each section validates its own fields (`validate()` next to its dataclass); what joins two or more
sections lives here, in one place, and runs after them (RunConfig.validate). A check only reads the
config: it never fills in or changes a setting, so the saved config.json is exactly what was asked
for. Every refusal names the keys to change.
"""

from __future__ import annotations

from miles.config.loader import ConfigError


def check_run(run) -> None:
    """Every cross-section check of a RunConfig (run.py imports this module, so it takes the config untyped)."""
    for check in (check_schedule, check_sync, check_routing_replay, check_fleet):
        check(run)


def check_schedule(run) -> None:
    """The schedule against the placement, the staleness bound and the buffer's capacity."""
    schedule, mode = run.loop.schedule, run.placement.mode
    if schedule != "sync" and mode == "colocated":
        raise ConfigError(f"loop.schedule = {schedule!r} needs a disaggregated placement (colocated engines and "
                          "trainer take turns, so nothing could overlap): set placement.mode = 'disaggregated' "
                          "or loop.schedule = 'sync'")
    # How many policy versions a group can lag by construction: the weights it was generated under
    # are pushed every `update_weights_interval` steps, and one_step_off generates a step ahead.
    built_in = run.loop.update_weights_interval - 1 + (schedule == "one_step_off")
    if run.buffer.max_staleness < built_in:
        raise ConfigError(f"buffer.max_staleness = {run.buffer.max_staleness} would drop every group: with "
                          f"loop.schedule = {schedule!r} and loop.update_weights_interval = "
                          f"{run.loop.update_weights_interval} groups are {built_in} versions old by design; "
                          f"set buffer.max_staleness >= {built_in}")
    if schedule != "fully_async" and run.buffer.capacity < run.rollout.prompts_per_step:
        raise ConfigError(f"buffer.capacity = {run.buffer.capacity} cannot hold one step's "
                          f"{run.rollout.prompts_per_step} groups: set buffer.capacity >= rollout.prompts_per_step")
    if schedule == "fully_async" and run.buffer.capacity < 1:
        raise ConfigError("buffer.capacity must be >= 1")


def check_sync(run) -> None:
    from miles.sync.prepare import check_run as check

    check(run)


def check_routing_replay(run) -> None:
    from miles.trainer.r3 import check_run as check

    check(run)


def check_fleet(run) -> None:
    from miles.orchestration.fleet import check_run as check

    check(run)
