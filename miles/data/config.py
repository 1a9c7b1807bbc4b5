"""DataConfig: which rows a `dataset` prompt source reads (rollout.task.data) and how they map to prompts.

Loading a run config imports nothing heavy: the rows are read (with `datasets`) when the source is
built, and checked by the run before any engine starts (preflight.py). Non-goal: the rows' contents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.config import ConfigError
from miles.data.layouts import LAYOUTS, Layout


@dataclass
class DataConfig:
    path: str = ""
    """Train rows: a .jsonl/.json/.parquet file, a glob of such files, a `datasets` save_to_disk
    directory, or a hub dataset id already in the local cache (nothing is downloaded)."""
    eval_path: str = ""
    """Eval rows, in the same forms as path; empty = hold out eval_fraction of path's rows."""
    split: str = "train"
    """The split to read when path is a directory or hub id holding several (a DatasetDict)."""
    eval_split: str = ""
    """The split of eval_path (or of path, with eval_path empty) to evaluate on; empty = split for
    eval_path, or a held-out fraction of path."""
    eval_fraction: float = 0.1
    """Share of path's rows held out for eval when neither eval_path nor eval_split is set (0 = none:
    eval then draws from the train rows)."""
    layout: str = "custom"
    """Field mapping of the rows: verl, slime, trl or custom; the keys below override it."""
    prompt_key: str = ""
    """Field with the prompt (text or a list of {role, content} messages); empty = the layout's."""
    label_key: str = ""
    """Field with the reference answer, dotted for nested fields (reward_model.ground_truth); empty =
    the layout's; "none" = rows have no label."""
    metadata_keys: list[str] = field(default_factory=list)
    """Fields copied into each prompt's (and sample's) metadata; empty = the layout's; ["*"] = all other fields."""
    images_key: str = ""
    """Field with a row's images (one, or a list: paths, bytes, datasets Image features); empty = the
    layout's ("images", and "image" for trl)."""
    max_image_pixels: int = 4096 * 4096
    """Largest image accepted (width x height); a row with a larger one is refused before the run starts."""
    shuffle: bool = True
    """Shuffle the train rows anew each epoch, from run.seed and the epoch number."""
    num_epochs: int = 0
    """Passes over the train rows before the source runs dry (0 = as many as the run needs)."""

    def resolved(self) -> Layout:
        """The field mapping in effect: the layout's, with the keys set here taking precedence."""
        base = LAYOUTS[self.layout]
        label = self.label_key or base.label_key
        return Layout(self.prompt_key or base.prompt_key, "" if label == "none" else label,
                      tuple(self.metadata_keys) or base.metadata_keys,
                      (self.images_key,) if self.images_key else base.images_keys)

    def require_path(self) -> None:
        """Raise unless path names the rows (rollout.task.name = "dataset" needs them)."""
        if not self.path:
            raise ConfigError("rollout.task.data.path is empty: name the train rows (a .jsonl, .json or "
                              ".parquet file, a glob, a save_to_disk directory or a cached hub id)")

    def validate(self) -> None:
        if self.layout not in LAYOUTS:
            raise ConfigError(f"rollout.task.data.layout: {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError("rollout.task.data.eval_fraction must be in [0, 1)")
        if self.max_image_pixels < 1:
            raise ConfigError("rollout.task.data.max_image_pixels must be >= 1 (width x height of the largest image)")
        if self.num_epochs < 0:
            raise ConfigError("rollout.task.data.num_epochs must be >= 0 (0 = unlimited)")
