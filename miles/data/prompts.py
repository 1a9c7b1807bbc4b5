"""Prompt sources: a named, seeded task that yields prompts with reference labels.

The source remembers its position, so every prompt drawn has an index that the buffer ledger and
checkpoints can refer to; a source with state of its own (a dataset's cursor, miles/data) saves it
with the position. The tasks themselves are in data/tasks/ (and with their environment, for tasks
that need one). Non-goal: reading files (loading.py, source.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.buffer.types import PromptImage, as_images
from miles.config import ConfigError
from miles.data.config import DataConfig
from miles.registry import RegistryError
from miles.data.tasks import TASKS


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """Prompt source by name: arithmetic, terminal (shell tasks for the terminal environment), dataset
    (rows from files, see rollout.task.data), or a module:function taking (TaskConfig, split, seed)
    and returning an object with take(n)."""
    digits: int = 2
    """arithmetic: operand digits."""
    ops: str = "+-"
    """arithmetic: operators to draw from ('+', '-', or both)."""
    eval_fraction: float = 0.1
    """arithmetic: share of all problems reserved for eval (disjoint from train)."""
    fixed_width: bool = False
    """arithmetic: zero-pad operands and answers to a fixed width (07+38=045)."""
    apply_chat_template: bool = False
    """Wrap each plain-text prompt as a user message with the tokenizer's chat template (prompts that
    are lists of messages always go through it)."""
    system_prompt: str = ""
    """A system message put before every chat-templated prompt that has none of its own."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments to the tokenizer's apply_chat_template, e.g. {enable_thinking = false}."""
    data: DataConfig = field(default_factory=DataConfig)
    """dataset: the rows, their layout and field mapping, splits and epochs."""
    allow_long_labels: bool = False
    """Run even when labels take more tokens than the max_new_tokens they are generated under (a
    reward that credits part of an answer); otherwise the run refuses them before it starts."""

    def validate(self) -> None:
        try:
            TASKS.get(self.name)
        except RegistryError as e:
            raise ConfigError(f"rollout.task.name: {e}") from None
        if not 1 <= self.digits <= 9:
            raise ConfigError("rollout.task.digits must be in 1..9")
        if not self.ops or set(self.ops) - {"+", "-"}:
            raise ConfigError("rollout.task.ops must use only '+' and '-', e.g. \"+-\"")
        if not 0 < self.eval_fraction < 1:
            raise ConfigError("rollout.task.eval_fraction must be between 0 and 1")
        if not isinstance(self.chat_template_kwargs, dict):
            raise ConfigError("rollout.task.chat_template_kwargs must be a table, e.g. {enable_thinking = false} "
                              "in the run config")
        if self.name == "dataset":
            self.data.require_path()


@dataclass(frozen=True)
class Prompt:
    index: int                          # position in the source's order (the ledger key)
    text: str                           # the prompt as text (a chat prompt: its rendered form, if any)
    label: str | None                   # the reference answer, for verifiable rewards
    messages: list[dict] | None = field(default=None, compare=False)  # a chat prompt's messages
    metadata: dict = field(default_factory=dict, compare=False)       # the row's other fields
    images: tuple[PromptImage, ...] = field(default=(), compare=False)  # in the order of the image parts

    def __post_init__(self):
        object.__setattr__(self, "images", as_images(self.images))  # also from a checkpoint's JSON


class PromptSource:
    """Draws prompts of one split in a fixed order determined by the seed."""

    def __init__(self, cfg: TaskConfig, split: str, seed: int):
        self.task = TASKS.get(cfg.name)(cfg, split, seed)
        self.position = 0

    def take(self, n: int) -> list[Prompt]:
        out = []
        for p in self.task.take(n):
            out.append(Prompt(index=self.position, text=p.prompt, label=p.answer,
                              messages=getattr(p, "messages", None), metadata=dict(getattr(p, "metadata", None) or {}),
                              images=getattr(p, "images", ())))
            self.position += 1
        return out

    def state_dict(self) -> dict:
        """The position and, for a source that has one (a dataset's cursor), the source's own state."""
        state = getattr(self.task, "state_dict", None)
        return {"position": self.position, "task": state() if state else None}

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state_dict()` was taken; a source without state of its own is replayed."""
        if state["task"] is not None and hasattr(self.task, "load_state_dict"):
            self.task.load_state_dict(state["task"])
            self.position = state["position"]
        while self.position < state["position"]:
            self.take(1)
