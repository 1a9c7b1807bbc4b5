"""`miles bench trl --device cuda` puts every miles contender on the GPU in bf16 with a context its
engine's fast decode can hold, and the overrides make a valid run config on either device; asked for
cuda where torch sees none, it says so before building anything."""

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
