"""Runs for tests: small run configs for end-to-end runs, and run directories as `miles train`
writes them, for the report and dashboard tests."""

from __future__ import annotations

import json
from pathlib import Path

from miles.config import load_config
from miles.run_config import RunConfig
from miles.metrics.sink import JsonlSink


def small_config(model_dir, out_dir, config_path=None, **over):
    """A few steps of the arithmetic task on a tiny model (`config_path`: a TOML file underneath the overrides)."""
    base = {"model.path": model_dir, "run.output_dir": str(out_dir), "run.name": "e2e",
            "loop.num_steps": "3", "eval.every_steps": "2", "eval.num_prompts": "16",
            "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "4",
            "eval.max_new_tokens": "4", "trainer.lr": "1e-3", "sync.bucket_size_mb": "1"}
    base.update(over)
    return load_config(RunConfig, config_path, base)


def new_run(path: Path, num_steps: int) -> JsonlSink:
    """Create the run directory `path` with its config.json (a run of `num_steps` steps) and return the
    sink writing its metrics.jsonl."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"loop": {"num_steps": num_steps}}))
    return JsonlSink(path / "metrics.jsonl")
