"""Device resolution and float32 numerics (miles/devices.py): the main job computes the same numbers
on cuda as on cpu unless configured otherwise."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from miles.config.loader import load_config
from miles.devices import TF32_OVERRIDE, exact_float32
from miles.orchestration.placement import place_devices
from miles.run_config import RunConfig

ARITHMETIC = Path(__file__).resolve().parents[2] / "examples" / "arithmetic"


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_exact_float32_drops_an_images_tf32_override_and_multiplies_in_full_float32(monkeypatch, matmul_precision):
    monkeypatch.setenv(TF32_OVERRIDE, "1")  # as NVIDIA's PyTorch containers ship
    torch.set_float32_matmul_precision("high")  # TF32 allowed
    exact_float32()
    assert TF32_OVERRIDE not in os.environ
    assert torch.get_float32_matmul_precision() == "highest"


def _placed(cfg: RunConfig, gpus: float) -> RunConfig:
    """The config as a run on a cluster with `gpus` GPUs makes it concrete (launch.place_run_devices)."""
    trainer, engine, _ = place_devices(cfg.trainer.device, cfg.rollout.engine.device, gpus, cfg.trainer.num_ranks,
                                       cfg.rollout.num_engines)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, device=trainer),
                               rollout=dataclasses.replace(cfg.rollout, engine=dataclasses.replace(
                                   cfg.rollout.engine, device=engine)))


@pytest.mark.parametrize("recipe", ["sft.toml", "grpo.toml"])
def test_the_arithmetic_main_job_resolves_to_the_same_numerics_whichever_device_auto_picks(tiny_model_dir, recipe):
    cfg = load_config(RunConfig, str(ARITHMETIC / recipe), {"model.path": tiny_model_dir})
    on_cpu, on_gpu = _placed(cfg, gpus=0), _placed(cfg, gpus=1)
    assert (on_cpu.trainer.device, on_cpu.rollout.engine.device) == ("cpu", "cpu")
    assert (on_gpu.trainer.device, on_gpu.rollout.engine.device) == ("cuda", "cuda")
    # float32 compute and weights on both; nothing else differs but the devices.
    for placed in (on_cpu, on_gpu):
        assert placed.trainer.param_dtype == placed.rollout.engine.dtype == "float32"
        assert placed.wire_dtype() is None and placed.trainer.quantization == placed.rollout.engine.quantization

    def without_devices(c: RunConfig) -> dict:
        d = dataclasses.asdict(c)
        d["trainer"]["device"] = d["rollout"]["engine"]["device"] = None
        return d

    assert without_devices(on_cpu) == without_devices(on_gpu)


@pytest.mark.cuda
def test_cuda_a_trainer_on_the_gpu_multiplies_float32_in_float32(matmul_precision):
    from miles.trainer.device import compute_device

    device = compute_device("cuda", 0)
    assert torch.get_float32_matmul_precision() == "highest"
    a, b = torch.randn(512, 512, device=device), torch.randn(512, 512, device=device)
    ref = a.double() @ b.double()
    assert float(((a @ b).double() - ref).norm() / ref.norm()) < 1e-5  # TF32 rounds to about 1e-4
