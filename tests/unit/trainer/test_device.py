"""Trainer device, compute dtype and collective backend come from config, with CPU defaults.

CPU tests run everywhere; the tests marked `cuda` run only where torch sees a CUDA device
(scripts/gpu-check.sh runs it)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from miles.config.loader import ConfigError, build
from miles.data.prompts import PromptSource, TaskConfig
from miles.devices import resolve
from miles.models.loading import load_tokenizer
from miles.net import free_port
from miles.trainer.config import TrainerConfig
from miles.trainer.device import HOST, collective_backend, compute_device
from miles.trainer.sft import demonstration_sequences
from miles.trainer.trainer import Trainer
from miles.trainer.types import BatchTotals, TrainSequence


def _seqs():
    return [TrainSequence(tokens=[5, 9, 14, 20, 31, 7], prompt_len=2, loss_mask=[1] * 4, old_logprobs=[-3.0] * 4,
                          advantage=a) for a in (1.0, -1.0)]


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_defaults_are_auto_float32_and_auto_is_cpu_without_a_gpu():
    cfg = TrainerConfig()
    assert (cfg.device, cfg.param_dtype) == ("auto", "float32")
    assert resolve("auto", "trainer.device", gpu_present=False) == "cpu"
    assert resolve("auto", "trainer.device", gpu_present=True) == "cuda"
    assert compute_device("auto", 0) == (torch.device("cuda", 0) if torch.cuda.is_available() else HOST)
    assert collective_backend("cpu", cfg.collective_backend) == "gloo"
    assert collective_backend("cuda") == "nccl"
    assert compute_device("cpu", 3) == HOST


def test_an_unknown_device_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="device: 'tpu' is not one of 'auto', 'cpu', 'cuda'"):
        build(TrainerConfig, {"device": "tpu"}).validate()


def test_nccl_on_cpu_and_parallel_layouts_off_cpu_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="trainer.device = 'cuda'"):
        build(TrainerConfig, {"collective_backend": "nccl", "device": "cpu"}).validate()
    with pytest.raises(ConfigError, match="param_dtype = 'float32'"):
        build(TrainerConfig, {"param_dtype": "bfloat16", "num_ranks": 2, "tensor_parallel_size": 2}).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_names_the_setting():
    with pytest.raises(ConfigError, match="trainer.device = 'cuda' but torch sees no CUDA device here: set "
                                         "trainer.device = 'cpu'"):
        compute_device("cuda", 0)


def test_the_cpu_trainer_is_unchanged_by_default(tiny_model_dir, gloo):
    """One float32 rank trains the plain module (no FSDP wrapping) and hands out the very tensors it holds."""
    trainer = Trainer(build(TrainerConfig, {"lr": 1e-2}), tiny_model_dir, 0, 1, "127.0.0.1", free_port())
    assert trainer.backend.device == HOST
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in trainer.backend.model.parameters())
    name, out = next(iter(trainer.full_named_tensors()))
    assert out.data_ptr() == dict(trainer.backend.model.named_parameters())[name].data_ptr()  # no copy on the way out


def test_bfloat16_compute_keeps_float32_master_weights(tiny_model_dir, gloo):
    trainer = Trainer(build(TrainerConfig, {"param_dtype": "bfloat16", "lr": 1e-2}), tiny_model_dir, 0, 1,
                          "127.0.0.1", free_port())
    seen = []
    layer = trainer.backend.model.model.layers[0].mlp.down_proj
    hook = layer.register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, out.dtype)))
    name = "model.layers.0.self_attn.q_proj.weight"
    before = dict(trainer.backend.model.named_parameters())[name].detach().clone()
    metrics = trainer.train_step(_seqs(), BatchTotals.of(_seqs()))
    hook.remove()
    assert seen and all(d == (torch.bfloat16, torch.bfloat16) for d in seen)  # the forward computes in bf16
    assert metrics["train/grad_norm"] > 0
    after = dict(trainer.backend.model.named_parameters())[name]
    assert after.dtype == torch.float32 and not torch.equal(after.detach(), before)  # fp32 master moved
    moments = [v for opt in trainer.backend.optim.optimizers for st in opt.state.values() for v in st.values() if v.dim()]
    assert moments and all(v.dtype == torch.float32 for v in moments)  # Adam's state is float32 too
    out = dict(trainer.full_named_tensors())
    assert out[name].dtype == torch.float32 and out[name].device == HOST


@pytest.mark.cuda
def test_a_cuda_trainer_steps_on_nccl_and_hands_weights_out_through_host_memory(tiny_model_dir):
    trainer = Trainer(build(TrainerConfig, {"device": "cuda", "param_dtype": "bfloat16", "lr": 1e-2}),
                          tiny_model_dir, 0, 1, "127.0.0.1", free_port())
    try:
        assert dist.get_backend() == "nccl" and trainer.backend.device.type == "cuda"
        assert all(p.device.type == "cuda" for p in trainer.backend.model.parameters())
        assert trainer.train_step(_seqs(), BatchTotals.of(_seqs()))["train/grad_norm"] > 0
        out = dict(trainer.full_named_tensors())
        assert all(t.device == HOST and t.dtype == torch.float32 for t in out.values())
    finally:
        dist.destroy_process_group()


def _sft_trajectory(model_dir: str, device: str, threads: int, steps: int) -> tuple[list[float], list[float], list[bool]]:
    """The main job's warm start for `steps` steps on `device` (its recipe's optimizer settings, float32):
    each step's nll and gradient norm, then which held-out demonstrations greedy decoding reproduces."""
    tok = load_tokenizer(model_dir)
    task = TaskConfig(digits=2, ops="+-", fixed_width=True)

    def demos(split, n):
        return demonstration_sequences(PromptSource(task, split, 1).take(n), tok,
                                       lambda p: tok(p.text, add_special_tokens=False).input_ids)

    data, held_out, rng = demos("train", 512), demos("eval", 64), random.Random(0)
    trainer = Trainer(build(TrainerConfig, {"device": device, "lr": 3e-3, "weight_decay": 0.01, "num_threads": threads}),
                      model_dir, 0, 1, "127.0.0.1", free_port())
    try:
        nll, norms = [], []
        for _ in range(steps):
            batch = rng.sample(data, 64)
            m = trainer.train_step(batch, BatchTotals.of(batch), algorithm="sft")
            nll.append(m["sft/nll"])
            norms.append(m["sft/grad_norm"])
        return nll, norms, trainer.greedy_matches(held_out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("other", [pytest.param("cuda", marks=pytest.mark.cuda), "cpu"])
def test_the_main_jobs_warm_start_follows_the_same_trajectory_on_another_device(tiny_model_dir, other):
    """SFT's first steps in float32 on cuda (or on two CPU threads) against one CPU thread: the same
    loss and gradient norm at the first step up to rounding, and after 30 steps a trajectory that has
    parted from the CPU's by rounding only. A wrong mask, dtype or loss on the device shows at once."""
    steps = 30
    ref_nll, ref_norm, ref_hits = _sft_trajectory(tiny_model_dir, "cpu", 1, steps)
    nll, norm, hits = _sft_trajectory(tiny_model_dir, other, 2 if other == "cpu" else 1, steps)
    assert nll[0] == pytest.approx(ref_nll[0], rel=1e-5) and norm[0] == pytest.approx(ref_norm[0], rel=1e-4)
    assert ref_nll[-1] < 0.8 * ref_nll[0]  # it learns, so the comparison is of a moving trajectory
    assert max(abs(a - b) / b for a, b in zip(nll, ref_nll)) < 0.02, (nll, ref_nll)
    assert sum(a != b for a, b in zip(hits, ref_hits)) <= 3, (hits, ref_hits)
