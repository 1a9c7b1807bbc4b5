"""Ready field mappings for the dataset formats users bring from other frameworks.

A layout names the row fields that hold the prompt, the label and the metadata; keys set in
`rollout.task.data` override the layout's. Non-goal: converting files (rows are read as they are).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    prompt_key: str
    label_key: str                 # "" = rows carry no label
    metadata_keys: tuple[str, ...]  # ("*",) = every field that is neither prompt nor label
    images_keys: tuple[str, ...] = ("images",)  # the field holding a row's images: the first one present


LAYOUTS: dict[str, Layout] = {
    # verl's RL parquet: prompt = chat messages, reward_model = {"ground_truth": ..., "style": ...};
    # vision rows: an "images" column and {"type": "image"} parts in the messages.
    "verl": Layout("prompt", "reward_model.ground_truth", ("data_source", "extra_info", "ability")),
    # slime's JSONL (--input-key input --label-key label --metadata-key metadata).
    "slime": Layout("input", "label", ("metadata",)),
    # TRL's prompt-only datasets: a "prompt" column, plain text or conversational; other columns are
    # passed to reward functions, so they become metadata.
    # Vision datasets: an "images" (or a single "image") column beside the prompt.
    "trl": Layout("prompt", "", ("*",), ("images", "image")),
    # No defaults beyond a "prompt" and a "label" field.
    "custom": Layout("prompt", "label", ()),
}
