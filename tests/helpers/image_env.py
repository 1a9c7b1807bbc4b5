"""An environment that answers with a picture, for vision-language agent tests: the first observation
is the task's text (the prompt's images go with it), each reply shows a freshly drawn image with a
line of text, and the episode ends after `turns` model turns with reward 1 when the model said
"blue" (the colour of the second picture)."""

from __future__ import annotations

from miles.buffer.types import PromptImage
from miles.rollout.environments.contract import Observation, StepResult
from tests.helpers.images import png

COLOURS = ["blue", "green", "yellow"]


class PictureEnv:
    def __init__(self, turns: int = 2):
        self.turns, self.actions, self.closed = turns, [], False

    def reset(self, task) -> str:
        return task.text

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        n = len(self.actions)
        if n >= self.turns:
            return StepResult(observation="", reward=float("blue" in action.lower()), done=True)
        image = PromptImage.of(png(COLOURS[(n - 1) % 3], (40 + 16 * n, 48), dot=(12, 20)))
        return StepResult(observation=Observation(f"Picture {n}: which colour?", (image,)))

    def close(self) -> None:
        self.closed = True


def picture_env(turns: int = 2) -> PictureEnv:
    return PictureEnv(turns)
