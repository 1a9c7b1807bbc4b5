"""An environment that answers with a picture, for vision-language agent tests: the first observation
is the task's text (the prompt's images go with it), each reply shows a freshly drawn image with a
line of text, and the episode ends after `turns` model turns with reward 1 when the model said
"blue" (the colour of the second picture)."""

from __future__ import annotations

import io

from PIL import Image

from miles.buffer.types import PromptImage
from miles.rollout.environments.contract import Observation, StepResult
from tests.helpers.images import png

COLOURS = ["blue", "green", "yellow"]


class PictureEnv:
    """`form`: how a reply's picture is given: "prompt_image" (a PromptImage), "bytes" (the PNG file's
    bytes, alone), "pil" (a PIL image in a list) or "broken" (bytes that are no image)."""

    def __init__(self, turns: int = 2, form: str = "prompt_image"):
        self.turns, self.form, self.actions, self.closed = turns, form, [], False

    def reset(self, task) -> str:
        return task.text

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        n = len(self.actions)
        if n >= self.turns:
            return StepResult(observation="", reward=float("blue" in action.lower()), done=True)
        raw = png(COLOURS[(n - 1) % 3], (40 + 16 * n, 48), dot=(12, 20))
        images = {"prompt_image": lambda: (PromptImage.of(raw),), "bytes": lambda: raw,
                  "pil": lambda: [Image.open(io.BytesIO(raw))], "broken": lambda: (b"not an image",)}[self.form]()
        return StepResult(observation=Observation(f"Picture {n}: which colour?", images))

    def close(self) -> None:
        self.closed = True


def picture_env(turns: int = 2) -> PictureEnv:
    return PictureEnv(turns)
