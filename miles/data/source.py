"""DatasetSource: the `dataset` prompt source (rollout.task.name = "dataset").

Reads its split's rows once (loading.py), checks every one (rows.py), and draws them through a
DataCursor: train rows in seeded per-epoch shuffles, eval rows once each in file order. The split
is a separate file (data.eval_path), a named split (data.eval_split), or a held-out share of the
train rows (data.eval_fraction), fixed regardless of the run's seed so every run evaluates on the
same rows. Non-goals: tokenizing and chat templates (chat.py), prompt lengths (preflight.py).
"""

from __future__ import annotations

import os
import random

from miles.data.config import DataConfig
from miles.data.cursor import DataCursor
from miles.data.loading import load_rows
from miles.data.rows import DataError, Record, to_record


def split_records(cfg: DataConfig, split: str) -> list[Record]:
    """The checked Records of one split ("train" or "eval"); raises DataError naming file, row and field."""
    layout = cfg.resolved()
    if split == "eval" and cfg.eval_path:
        path, name = cfg.eval_path, cfg.eval_split or cfg.split
    elif split == "eval" and cfg.eval_split:
        path, name = cfg.path, cfg.eval_split
    else:
        path, name = cfg.path, cfg.split
    rows = load_rows(path, name)
    if not rows:
        raise DataError(f"{path}: no rows (split {name!r})")
    indices = list(range(len(rows)))
    if not cfg.eval_path and not cfg.eval_split and cfg.eval_fraction > 0:
        random.Random("miles-eval-holdout").shuffle(indices)
        n_eval = max(1, round(len(rows) * cfg.eval_fraction))
        if n_eval >= len(rows):
            raise DataError(f"{path}: {len(rows)} rows leave none for training after holding out "
                            f"rollout.task.data.eval_fraction = {cfg.eval_fraction}; lower it or set eval_path")
        indices = sorted(indices[:n_eval] if split == "eval" else indices[n_eval:])
    base_dir = os.path.dirname(path) if os.path.isfile(path) else path if os.path.isdir(path) else "."
    return [to_record(rows[i], layout, f"{path} row {i}", base_dir, cfg.max_image_pixels) for i in indices]


class DatasetSource:
    """take(n) -> Records; state_dict()/load_state_dict() carry the cursor through checkpoints."""

    def __init__(self, cfg: DataConfig, split: str, seed: int):
        self.split = split
        self.records = split_records(cfg, split)
        train = split == "train"
        self.cursor = DataCursor(len(self.records), seed, cfg.shuffle and train, cfg.num_epochs if train else 1)

    def take(self, n: int) -> list[Record]:
        if self.split == "eval":  # each eval row once: asking for more gives all there are
            n = min(n, self.cursor.num_rows - self.cursor.position)
        return [self.records[self.cursor.next()] for _ in range(n)]

    def state_dict(self) -> dict:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.cursor.load_state_dict(state)


def task_source(task_cfg, split: str, seed: int) -> DatasetSource:
    """The TASKS factory: (TaskConfig, split, seed) -> DatasetSource over task_cfg.data."""
    return DatasetSource(task_cfg.data, split, seed)
