"""Loop settings shared by the schedules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class LoopConfig:
    schedule: Literal["sync"] = "sync"
    """sync: generate → train → sync weights, one after another."""
    num_steps: int = 20
    """RL training steps."""
    save_every: int = 0
    """Export a Hugging Face checkpoint every this many steps (0 = only at the end)."""
    update_weights_interval: int = 1
    """Push weights to the engines every this many steps."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.num_steps < 0 or self.save_every < 0 or self.update_weights_interval < 1:
            raise ConfigError("loop.num_steps >= 0, loop.save_every >= 0, loop.update_weights_interval >= 1")
