"""Loop settings shared by the schedules, and the checks that join loop, placement and buffer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class LoopConfig:
    schedule: Literal["sync", "one_step_off", "fully_async"] = "sync"
    """sync: generate → train → sync weights in turn; one_step_off: generate step k+1 while training
    step k; fully_async: engines never wait, the trainer collects finished groups from the buffer."""
    num_steps: int = 20
    """RL training steps."""
    save_every: int = 0
    """Export a Hugging Face checkpoint every this many steps (0 = only at the end)."""
    update_weights_interval: int = 1
    """Push weights to the engines every this many steps."""
    pause_mode: Literal["none", "abort", "retract", "in_place"] = "none"
    """Overlapped schedules: how engines treat in-flight requests during a weight push. none: keep
    decoding, the new version is applied between two decode steps; abort: in-flight requests end
    (resumed from their prefix with rollout.partial_rollout, else their groups are retried);
    retract: requests are set aside and re-run under the new weights; in_place: decoding pauses and
    continues on the new weights with the KV cache kept."""
    collect_timeout_s: float = 1800.0
    """fully_async: fail the run if the trainer waits this long for one step's groups."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.num_steps < 0 or self.save_every < 0 or self.update_weights_interval < 1:
            raise ConfigError("loop.num_steps >= 0, loop.save_every >= 0, loop.update_weights_interval >= 1")
        if self.collect_timeout_s <= 0:
            raise ConfigError("loop.collect_timeout_s must be > 0")


def check_run(cfg) -> None:
    """Combinations of loop, placement, buffer and rollout settings that cannot run, refused early."""
    from miles.config import ConfigError

    schedule, mode = cfg.loop.schedule, cfg.placement.mode
    if schedule != "sync" and mode == "colocated":
        raise ConfigError(f"loop.schedule = {schedule!r} needs a disaggregated placement (colocated engines and "
                          "trainer take turns, so nothing could overlap): set placement.mode = 'disaggregated' "
                          "or loop.schedule = 'sync'")
    # How many policy versions a group can lag by construction: the weights it was generated under
    # are pushed every `update_weights_interval` steps, and one_step_off generates a step ahead.
    built_in = cfg.loop.update_weights_interval - 1 + (schedule == "one_step_off")
    if cfg.buffer.max_staleness < built_in:
        raise ConfigError(f"buffer.max_staleness = {cfg.buffer.max_staleness} would drop every group: with "
                          f"loop.schedule = {schedule!r} and loop.update_weights_interval = "
                          f"{cfg.loop.update_weights_interval} groups are {built_in} versions old by design; "
                          f"set buffer.max_staleness >= {built_in}")
    if schedule != "fully_async" and cfg.buffer.capacity < cfg.rollout.prompts_per_step:
        raise ConfigError(f"buffer.capacity = {cfg.buffer.capacity} cannot hold one step's "
                          f"{cfg.rollout.prompts_per_step} groups: set buffer.capacity >= rollout.prompts_per_step")
    if schedule == "fully_async" and cfg.buffer.capacity < 1:
        raise ConfigError("buffer.capacity must be >= 1")
