"""The prompt-source contract: a task draws problems, each a prompt text and its reference answer.

The prompt source (data/prompts.py) numbers the problems it takes and turns them into Prompts;
a task only knows its own content. Non-goals: tokenization, chat templates, scoring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    """One drawn problem: the text the model is shown and the reference answer (a Prompt's label)."""

    prompt: str
    answer: str | None
    messages: list[dict] | None = None  # a conversational prompt (its template is applied at encode time)
    metadata: dict = field(default_factory=dict)  # carried onto the prompt and its samples


class TaskSource(Protocol):
    def take(self, n: int) -> list[Problem]:
        """The next `n` problems of this source's split, in a fixed order given by its seed."""
