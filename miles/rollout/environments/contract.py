"""The environment contract: what the agent loop asks of an environment, and what one step returns.

An environment is one episode's world: `reset(task)` starts it and returns the first observation
(the user message); each `step(action)` takes the model's text for one turn and returns what the
environment says back, the reward earned and whether the episode is over. The agent loop
(rollout/agent/episode.py) owns tokens; environments only ever see and produce text.

This module imports nothing of miles, so every environment (built-in or a user's) can import it
without pulling in the others. Non-goals: batched/vectorised environments, environment-side
tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one model turn."""

    observation: str   # shown to the model as the next environment turn (ignored when done)
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    def reset(self, task) -> str:
        """Start an episode for `task` (a data-source Prompt: .text, .label, .index); return the first
        observation."""

    def step(self, action: str) -> StepResult:
        """Apply the model's turn (its text, special tokens stripped)."""

    def close(self) -> None:
        """Release what the episode holds (sandboxes, files); called once, also after a timeout."""
