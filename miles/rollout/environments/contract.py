"""The environment contract: what the agent loop asks of an environment, and what one step returns.

An environment is one episode's world: `reset(task)` starts it and returns the first observation
(the user message); each `step(action)` takes the model's text for one turn and returns what the
environment says back, the reward earned and whether the episode is over. The agent loop
(rollout/agent/episode.py) owns tokens; environments only ever see text and produce text, or, for a
vision-language model, an `Observation`: text plus images (PromptImage, buffer/types.py), which the
model sees before the text. An environment that returns plain text from `reset` shows the model the
prompt's own images, if it has any; one that returns an Observation shows exactly its images.

This module imports nothing of miles, so every environment (built-in or a user's) can import it
without pulling in the others. Non-goals: batched/vectorised environments, environment-side
tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Observation:
    """What the model is shown, with images: `Observation(text, (PromptImage.of(png_bytes),))`."""

    text: str
    images: tuple = ()  # shown before the text in this order (a vision-language model only): PromptImages,
                        # encoded image bytes, file paths or PIL images; one may stand alone


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one model turn."""

    observation: str | Observation  # shown to the model as the next environment turn (ignored when done)
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    def reset(self, task) -> str | Observation:
        """Start an episode for `task` (a data-source Prompt: .text, .label, .index, .images); return the
        first observation."""

    def step(self, action: str) -> StepResult:
        """Apply the model's turn (its text, special tokens stripped)."""

    def close(self) -> None:
        """Release what the episode holds (sandboxes, files); called once, also after a timeout."""
