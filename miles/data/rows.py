"""A dataset row as a checked Record: the prompt (text or chat messages), the label, the metadata,
the images (images.py).

Every problem is reported as a DataError naming the file, the row and the field, so a bad row stops
the run before anything starts. Non-goals: reading files (loading.py), prompt lengths (preflight.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.buffer.types import PromptImage
from miles.data.errors import DataError
from miles.data.images import place_images, row_images
from miles.data.layouts import Layout

__all__ = ["DataError", "Record", "lookup", "to_record"]

_MISSING = object()


@dataclass(frozen=True)
class Record:
    """One row as the prompt source hands it on (the fields of a rollout Prompt, less the index)."""

    prompt: str                          # the text (for messages: the last user turn, for logs and eval)
    answer: str | None                   # the label, as text
    messages: list[dict] | None = None   # a conversational prompt
    metadata: dict = field(default_factory=dict)
    where: str = field(default="", compare=False)  # "data.jsonl row 7", for errors found later
    images: tuple[PromptImage, ...] = ()  # in the order of the messages' image parts


def lookup(row: dict, dotted: str):
    """The value at a dotted key (reward_model.ground_truth), or _MISSING."""
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def to_record(row: dict, layout: Layout, where: str, base_dir: str = ".", max_image_pixels: int = 0) -> Record:
    """The Record of `row`; `where` names it in errors ("data.jsonl row 7"). Image paths are read
    relative to `base_dir` (the data file's folder) first."""
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
    images: tuple[PromptImage, ...] = ()
    images_key = next((k for k in layout.images_keys if lookup(row, k) not in (_MISSING, None)), None)
    if images_key is not None:
        images = row_images(lookup(row, images_key), images_key, where, base_dir, max_image_pixels)
    if images:
        chat = messages if messages is not None else [{"role": "user", "content": text}]
        messages = place_images(chat, len(images), images_key, where)
    elif messages is not None and any(isinstance(m["content"], list) and any(p["type"] != "text" for p in m["content"])
                                      for m in messages):
        raise DataError(f"{where}: the messages have image parts but the row has no images (fields "
                        f"{', '.join(layout.images_keys)}); set rollout.task.data.images_key")
    keys = layout.metadata_keys
    if keys == ("*",):
        top = {layout.prompt_key.split(".")[0], layout.label_key.split(".")[0], *layout.images_keys}
        keys = tuple(k for k in row if k not in top)
    metadata = {k: v for k in keys if (v := lookup(row, k)) is not _MISSING}
    return Record(text, answer, messages, metadata, where, images)


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
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = _parts(content, f"{where}: field {key!r} message {i}")
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, (str, list))):
                raise DataError(f"{where}: field {key!r} message {i} is not a {{'role': str, 'content': str}} "
                                f"message: {m!r:.120}")
            messages.append({"role": m["role"], "content": content})
        if not any(_text(m["content"]).strip() or isinstance(m["content"], list) and len(m["content"]) > 0
                   for m in messages):
            raise DataError(f"{where}: field {key!r} (the prompt) has only empty messages")
        users = [_text(m["content"]) for m in messages if m["role"] == "user"]
        return (users[-1] if users else _text(messages[-1]["content"])), messages
    raise DataError(f"{where}: field {key!r} (the prompt) is a {type(value).__name__}, expected text or a "
                    "list of {role, content} messages")


def _parts(content: list, where: str) -> list[dict]:
    """A message's content parts (text and image), each as the chat template takes it; verl's and
    TRL's parts carry null for the keys of the other kinds (a parquet column holds every key)."""
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif kind in ("image", "image_url"):
            out.append({"type": "image"})
        else:
            raise DataError(f"{where} part {j} is not a {{'type': 'text', 'text': str}} or {{'type': 'image'}} "
                            f"part: {p!r:.120}")
    return out


def _text(content) -> str:
    """A message's text: its content, or its text parts joined."""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
