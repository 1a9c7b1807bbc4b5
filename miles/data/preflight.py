"""The run's check of its data before anything starts: every row of both splits loads and is well
formed (rows.py; images decoded and within the pixel limit, images.py), every prompt, as the
engines will see it (chat template and image tokens included), fits the engine's context with room
for at least one new token, and every label fits the response budget it is generated under.

The context is rollout.engine.context_length if set, else the model config's max_position_embeddings.
A label that takes more tokens than max_new_tokens can never be answered in full: rewards and eval
accuracy would measure the cut, not the model (while SFT, teacher-forced over the whole label, does
not), so `long_labels` finds them; which budget each split is generated under is the run's to say
(run_checks.label_budgets). Non-goal: checking rows while the run goes (a run that passed this
check never meets a bad row).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from miles.data.chat import encode_prompt
from miles.data.prompts import PromptSource, TaskConfig
from miles.data.rows import DataError
from miles.data.source import split_records


def context_length(model_path: str, configured: int | None) -> int | None:
    """The engine's context: its configured length, else the model's max_position_embeddings."""
    if configured:
        return configured
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    model = json.loads(config.read_text())
    # A vision-language config keeps the language model's length in its text_config.
    return model.get("max_position_embeddings") or (model.get("text_config") or {}).get("max_position_embeddings")


def check_dataset(task_cfg, tokenizer, model_path: str, configured_context: int | None,
                  vision=None) -> dict[str, int]:
    """Raise DataError naming the file, row and field of the first bad row; else the row counts.
    `tokenizer` is the model's and `vision` its VisionProcessor for a vision-language model (the
    caller loads them: data/ does not load models)."""
    limit = context_length(model_path, configured_context)
    counts = {}
    for split in ("train", "eval"):
        records = split_records(task_cfg.data, split)
        counts[split] = len(records)
        for r in records if limit else ():
            try:
                n = len(encode_prompt(tokenizer, task_cfg, r.prompt, r.messages, r.images, vision))
            except ValueError as exc:
                raise DataError(f"{r.where}: {exc}") from None
            if n >= limit:
                raise DataError(f"{r.where}: field {task_cfg.data.resolved().prompt_key!r} (the prompt) is {n} "
                                f"tokens, the engine's context is {limit} (rollout.engine.context_length or the "
                                "model's max_position_embeddings): shorten or drop the row")
    return counts


@dataclass(frozen=True)
class LabelBudget:
    """One split's labels and the response budget they are generated under."""

    task: TaskConfig
    split: str
    key: str            # the budget's setting, e.g. "eval.max_new_tokens"
    max_new_tokens: int
    allow_key: str      # the setting that accepts longer labels, e.g. "rollout.task.allow_long_labels"
    draws: int          # a generated task's prompts measured (a dataset's rows are all measured)


@dataclass(frozen=True)
class LongLabels:
    """The labels of one split that take more tokens than their budget."""

    budget: LabelBudget
    rows: int       # labels over the budget
    measured: int   # labels measured
    longest: int    # tokens of the longest label
    where: str      # where the longest label is

    def numbers(self) -> str:
        b = self.budget
        return (f"{self.rows} of {self.measured} {b.split} labels take more tokens than {b.key} = "
                f"{b.max_new_tokens}; the longest ({self.where}) is {self.longest} tokens")

    def message(self) -> str:
        b = self.budget
        return (f"{self.numbers()}. A response cut at {b.max_new_tokens} tokens cannot hold them, so rewards "
                f"and eval accuracy would measure the cut: set {b.key} >= {self.longest}, or {b.allow_key} = "
                "true to run anyway")


def long_labels(budget: LabelBudget, tokenizer, seed: int) -> LongLabels | None:
    """The labels of `budget`'s split over its max_new_tokens, as `tokenizer` counts them (the label
    alone, no special tokens), or None when all fit. A dataset's rows are all measured; a generated
    task's first `budget.draws` prompts, drawn with `seed`. Raises DataError for a bad row."""
    task = budget.task
    if task.name == "dataset":
        found = [(r.where, r.answer) for r in split_records(task.data, budget.split)]
    else:
        found = [(f"{task.name} prompt {p.index}, label {p.label!r}", p.label)
                 for p in PromptSource(task, budget.split, seed).take(budget.draws)]
    found = [(where, str(label)) for where, label in found if label is not None]
    if not found:
        return None
    lengths = [len(ids) for ids in tokenizer([label for _, label in found], add_special_tokens=False).input_ids]
    over = [n for n in lengths if n > budget.max_new_tokens]
    if not over:
        return None
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    return LongLabels(budget, len(over), len(found), lengths[longest], found[longest][0])


def check_labels(budgets: list[LabelBudget], tokenizer, seed: int) -> list[LongLabels]:
    """Raise DataError with the numbers for the first split whose labels do not fit its budget, unless
    its task sets allow_long_labels; the overflows so allowed are returned (for the run to warn of)."""
    allowed = []
    for budget in budgets:
        found = long_labels(budget, tokenizer, seed)
        if found is None:
            continue
        if not budget.task.allow_long_labels:
            raise DataError(found.message())
        allowed.append(found)
    return allowed
