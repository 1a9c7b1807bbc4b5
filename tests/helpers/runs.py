"""Small run configs for end-to-end tests: a few steps of the arithmetic task on a tiny model."""

from __future__ import annotations

from miles.config import load_config
from miles.config.run import RunConfig


def small_config(model_dir, out_dir, **over):
    base = {"model.path": model_dir, "run.output_dir": str(out_dir), "run.name": "e2e",
            "loop.num_steps": "3", "eval.every_steps": "2", "eval.num_prompts": "16",
            "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "4",
            "eval.max_new_tokens": "4", "trainer.lr": "1e-3", "sync.bucket_size_mb": "1"}
    base.update(over)
    return load_config(RunConfig, None, base)
