"""The run's check of a dataset before anything starts: every row of both splits loads and is well
formed (rows.py; images decoded and within the pixel limit, images.py), and every prompt, as the
engines will see it (chat template and image tokens included), fits the engine's context with room
for at least one new token.

The context is rollout.engine.context_length if set, else the model config's max_position_embeddings.
Non-goal: checking rows while the run goes (a run that passed this check never meets a bad row).
"""

from __future__ import annotations

import json
from pathlib import Path

from miles.data.chat import encode_prompt
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
