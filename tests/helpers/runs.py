"""Run directories as `miles train` writes them, for the report and dashboard tests."""

from __future__ import annotations

import json
from pathlib import Path

from miles.metrics.sink import JsonlSink


def new_run(path: Path, num_steps: int) -> JsonlSink:
    """Create the run directory `path` with its config.json (a run of `num_steps` steps) and return the
    sink writing its metrics.jsonl."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"loop": {"num_steps": num_steps}}))
    return JsonlSink(path / "metrics.jsonl")
