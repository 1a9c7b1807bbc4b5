"""Loop settings shared by the schedules, and the registry the schedule is chosen from.

A schedule is a function `(TrainContext) -> None` that runs steps `ctx.start_step + 1 ..
loop.num_steps` with the shared steps in orchestration/steps.py; a user's own is given as
`module:function`. Non-goal: checks across sections (miles/run_checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from miles.config.loader import ConfigError
from miles.registry import Registry

SCHEDULES: Registry[Callable] = Registry("schedule", arity=1, hint=" (a function taking the TrainContext)")
SCHEDULES.register("sync", "miles.orchestration.sync_loop:run_sync_loop")
SCHEDULES.register("one_step_off", "miles.orchestration.one_step_off:run_one_step_off_loop")
SCHEDULES.register("fully_async", "miles.orchestration.async_loop:run_fully_async_loop")


@dataclass
class LoopConfig:
    schedule: str = "sync"
    """sync: generate → train → sync weights in turn; one_step_off: generate step k+1 while training
    step k; fully_async: engines never wait, the trainer collects finished groups from the buffer; or
    module:function, a schedule of your own."""
    num_steps: int = 20
    """RL training steps."""
    save_every: int = 0
    """Write a resumable checkpoint and a Hugging Face export every this many steps (0 = only at the
    end), in the background behind the next steps; `miles train --resume` and fault.restart_trainer
    go back to the newest one fully written."""
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
        if self.num_steps < 0 or self.save_every < 0 or self.update_weights_interval < 1:
            raise ConfigError("loop.num_steps >= 0, loop.save_every >= 0, loop.update_weights_interval >= 1")
        if self.collect_timeout_s <= 0:
            raise ConfigError("loop.collect_timeout_s must be > 0")
        try:
            SCHEDULES.get(self.schedule)
        except ValueError as e:
            raise ConfigError(f"loop.schedule: {e}") from None
