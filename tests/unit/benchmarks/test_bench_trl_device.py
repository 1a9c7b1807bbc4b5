"""`miles bench trl --device cuda` puts every miles contender on the GPU in bf16 with a context its
engine's fast decode can hold, and the overrides make a valid run config on either device; asked for
cuda where torch sees none, it says so before building anything. Every checkpoint is scored on distinct
held-out problems."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import trl as bench
from miles.config import load_config
from miles.run_config import RunConfig


@pytest.mark.parametrize("schedule", ["sync", "fully_async"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_miles_overrides_make_a_valid_run_on_the_asked_device(tmp_path, tiny_model_dir, device, schedule):
    w = {"name": "long", "model": tiny_model_dir, "steps": 1, "prompts_per_step": 4, "samples": 8,
         "max_new_tokens": 256, "reward": bench.LONG_REWARD, "lr": 3e-4, "eval_new_tokens": 6, "filter": "none"}
    over = bench.miles_overrides(w, Path(tmp_path), schedule, 0, 2, device)
    cfg = load_config(RunConfig, bench.EXAMPLE / "grpo.toml", over)
    assert (cfg.trainer.device, cfg.rollout.engine.device) == (device, device)
    if device == "cuda":
        assert (cfg.rollout.engine.dtype, cfg.trainer.param_dtype) == ("bfloat16", "bfloat16")
        assert cfg.rollout.engine.context_length == 512 and cfg.rollout.engine.fast_decode == "auto"
    else:
        assert cfg.rollout.engine.dtype == "float32" and cfg.trainer.param_dtype == "float32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is seen")
def test_cuda_without_a_gpu_is_refused_by_name():
    with pytest.raises(SystemExit, match="--device cuda"):
        bench.main(["--device", "cuda", "--quick"])


def test_eval_problems_are_distinct_held_out_ones(tiny_model_dir):
    """The eval split draws with replacement; the bench scores each problem once, none from training."""
    held_out = bench.eval_prompts(tiny_model_dir, 3, 500)
    assert len(held_out) == 500 and len({p.text for p in held_out}) == 500
    assert held_out[:10] == bench.eval_prompts(tiny_model_dir, 3, 10)  # the same order, whatever n
    train = {p.text for p in bench.train_prompts(tiny_model_dir, 3, 4000)}
    assert not train & {p.text for p in held_out}
    assert len(bench.eval_prompts(tiny_model_dir, 3, 5000)) < 5000  # the split holds fewer: all of them
