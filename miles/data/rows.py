"""A dataset row as a checked Record: the prompt (text or chat messages), the label, the metadata.

Every problem is reported as a DataError naming the file, the row and the field, so a bad row stops
the run before anything starts. Non-goals: reading files (loading.py), prompt lengths (preflight.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.data.layouts import Layout

_MISSING = object()


class DataError(ValueError):
    """A row that cannot become a prompt: names the file, the row and the field."""


@dataclass(frozen=True)
class Record:
    """One row as the prompt source hands it on (the fields of a rollout Prompt, less the index)."""

    prompt: str                          # the text (for messages: the last user turn, for logs and eval)
    answer: str | None                   # the label, as text
    messages: list[dict] | None = None   # a conversational prompt
    metadata: dict = field(default_factory=dict)
    where: str = field(default="", compare=False)  # "data.jsonl row 7", for errors found later


def lookup(row: dict, dotted: str):
    """The value at a dotted key (reward_model.ground_truth), or _MISSING."""
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def to_record(row: dict, layout: Layout, where: str) -> Record:
    """The Record of `row`; `where` names it in errors ("data.jsonl row 7")."""
    prompt = lookup(row, layout.prompt_key)
    if prompt is _MISSING or prompt is None:  # a column other rows have reads as None where a row lacks it
        present = sorted(k for k, v in row.items() if v is not None)
        raise DataError(f"{where}: no field {layout.prompt_key!r} (the prompt); the row has "
                        f"{', '.join(present) or 'no fields'}; set rollout.task.data.prompt_key")
    text, messages = _prompt(prompt, layout.prompt_key, where)
    answer = None
    if layout.label_key:
        label = lookup(row, layout.label_key)
        if label is _MISSING or label is None:
            raise DataError(f"{where}: no field {layout.label_key!r} (the label); set rollout.task.data.label_key, "
                            "or \"none\" for rows without one")
        if isinstance(label, bool) or not isinstance(label, (str, int, float)):
            raise DataError(f"{where}: field {layout.label_key!r} (the label) is a {type(label).__name__}, "
                            "expected a string or a number")
        answer = str(label)
    keys = layout.metadata_keys
    if keys == ("*",):
        top = {layout.prompt_key.split(".")[0], layout.label_key.split(".")[0]}
        keys = tuple(k for k in row if k not in top)
    metadata = {k: v for k in keys if (v := lookup(row, k)) is not _MISSING}
    return Record(text, answer, messages, metadata, where)


def _prompt(value, key: str, where: str) -> tuple[str, list[dict] | None]:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field {key!r} (the prompt) is empty")
        return value, None
    if isinstance(value, list):
        if not value:
            raise DataError(f"{where}: field {key!r} (the prompt) is an empty list of messages")
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: field {key!r} message {i} is not a {{'role': str, 'content': str}} "
                                f"message: {m!r:.120}")
            messages.append({"role": m["role"], "content": m["content"]})
        if not any(m["content"].strip() for m in messages):
            raise DataError(f"{where}: field {key!r} (the prompt) has only empty messages")
        users = [m["content"] for m in messages if m["role"] == "user"]
        return (users[-1] if users else messages[-1]["content"]), messages
    raise DataError(f"{where}: field {key!r} (the prompt) is a {type(value).__name__}, expected text or a "
                    "list of {role, content} messages")
