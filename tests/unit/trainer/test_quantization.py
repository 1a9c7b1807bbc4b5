"""Quantization-aware training: the trainer's forward is the forward of the dequantized model, gradients
reach the float32 master weights straight through, and a step trains the weights the format stores."""

from __future__ import annotations

import pytest
import torch

from miles.config.loader import ConfigError, build
from miles.models.loading import load_model
from miles.net import free_port
from miles.precision.formats import dequantize, quantize
from miles.precision.linear import QuantizedLinear
from miles.trainer.config import TrainerConfig
from miles.trainer.forward import forward_logprobs
from miles.trainer.trainer import Trainer
from miles.trainer.types import BatchTotals, TrainSequence

FORMATS = ["fp8", "mxfp8", "nvfp4", "int4"]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (3, 12), generator=g)
    return ids, torch.ones_like(ids)


def dequantized_model(model_dir: str, fmt: str, state: dict | None = None, embeddings: bool = False):
    """A plain HF model whose Linear weights (not the LM head) are replaced by their stored values;
    `embeddings`: the (tied) embedding and LM head weight too."""
    model = load_model(model_dir, "float32")
    if state is not None:
        model.load_state_dict(state, strict=False)
    with torch.no_grad():
        for name, m in model.named_modules():
            if type(m) is torch.nn.Linear and not name.endswith("lm_head"):
                m.weight.copy_(dequantize(quantize(m.weight, fmt)))
        if embeddings:  # the preset ties the LM head to it: one weight to replace
            w = model.get_input_embeddings().weight
            w.copy_(dequantize(quantize(w, fmt)))
        for name, p in model.named_parameters():
            if ".experts." in name and p.dim() == 3:  # MoE: each expert's matrix on its own
                p.copy_(torch.stack([dequantize(quantize(w, fmt)) for w in p]))
    return model


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_trainers_forward_is_the_dequantized_models_and_gradients_go_straight_through(
        tiny_model_dir, gloo, fmt):
    trainer = Trainer(build(TrainerConfig, {"quantization": fmt}), tiny_model_dir, 0, 1, "127.0.0.1",
                          free_port())
    swapped = [n for n, m in trainer.backend.model.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(swapped) == 4 * 7 and not any("lm_head" in n for n in swapped)  # q,k,v,o,gate,up,down × 4 layers
    ids, mask = batch()
    logp, _ = forward_logprobs(trainer.backend.model, ids, mask)  # (B, T-1)
    ref = dequantized_model(tiny_model_dir, fmt)
    ref_logp, _ = forward_logprobs(ref, ids, mask)
    assert torch.allclose(logp, ref_logp, atol=1e-6, rtol=0)
    plain_logp, _ = forward_logprobs(load_model(tiny_model_dir, "float32"), ids, mask)
    assert (logp - plain_logp).abs().max() > 1e-4  # the format really changed the forward

    # Straight-through: the master weight's gradient is the dequantized weight's gradient.
    logp.sum().backward()
    ref_logp.sum().backward()
    layer = "model.layers.1.mlp.down_proj.weight"
    master = dict(trainer.backend.model.named_parameters())[layer]
    assert master.dtype == torch.float32 and master.grad is not None and master.grad.abs().sum() > 0
    assert torch.allclose(master.grad, dict(ref.named_parameters())[layer].grad, atol=1e-6, rtol=1e-5)


def test_with_quantize_embeddings_the_tied_embedding_and_lm_head_train_in_the_format(tiny_model_dir, gloo):
    trainer = Trainer(build(TrainerConfig, {"quantization": "nvfp4", "quantize_embeddings": True}),
                          tiny_model_dir, 0, 1, "127.0.0.1", free_port())
    ids, mask = batch()
    logp, _ = forward_logprobs(trainer.backend.model, ids, mask)
    ref = dequantized_model(tiny_model_dir, "nvfp4", embeddings=True)
    ref_logp, _ = forward_logprobs(ref, ids, mask)
    assert torch.allclose(logp, ref_logp, atol=1e-6, rtol=0)
    linears_only, _ = forward_logprobs(dequantized_model(tiny_model_dir, "nvfp4"), ids, mask)
    assert (logp - linears_only).abs().max() > 1e-4  # the embedding's format really changed the forward
    logp.sum().backward()
    ref_logp.sum().backward()  # straight through both uses of the tied weight: lookup and head
    name = "model.embed_tokens.weight"
    assert torch.allclose(dict(trainer.backend.model.named_parameters())[name].grad, dict(ref.named_parameters())[name].grad,
                          atol=1e-6, rtol=1e-5)


def test_moe_experts_train_in_the_format_too(tiny_moe_model_dir, gloo):
    trainer = Trainer(build(TrainerConfig, {"quantization": "nvfp4"}), tiny_moe_model_dir, 0, 1, "127.0.0.1",
                          free_port())
    ids, mask = batch()
    logp, _ = forward_logprobs(trainer.backend.model, ids, mask)
    ref = dequantized_model(tiny_moe_model_dir, "nvfp4")
    ref_logp, _ = forward_logprobs(ref, ids, mask)
    assert torch.allclose(logp, ref_logp, atol=1e-5, rtol=0)
    logp.sum().backward()
    ref_logp.sum().backward()
    name = "model.layers.2.mlp.experts.down_proj"
    got, want = dict(trainer.backend.model.named_parameters())[name].grad, dict(ref.named_parameters())[name].grad
    assert got.abs().sum() > 0 and torch.allclose(got, want, atol=1e-6, rtol=1e-4)


def test_a_step_updates_the_master_weights_and_the_next_forward_uses_their_stored_values(tiny_model_dir, gloo):
    trainer = Trainer(build(TrainerConfig, {"quantization": "nvfp4", "lr": 1e-2}), tiny_model_dir, 0, 1,
                          "127.0.0.1", free_port())
    before = {n: p.detach().clone() for n, p in trainer.backend.model.named_parameters()}
    seqs = [TrainSequence(tokens=[5, 9, 14, 20, 31, 7], prompt_len=2, loss_mask=[1] * 4, old_logprobs=[-3.0] * 4,
                          advantage=a) for a in (1.0, -1.0)]
    metrics = trainer.train_step(seqs, BatchTotals.of(seqs))
    assert metrics["train/grad_norm"] > 0
    name = "model.layers.0.self_attn.q_proj.weight"
    w = dict(trainer.backend.model.named_parameters())[name]
    assert not torch.equal(w, before[name])
    # Updates smaller than the format's step still accumulate in float32 (nothing is snapped to the grid).
    assert not torch.equal(w, dequantize(quantize(w, "nvfp4")))
    ids, mask = batch()
    logp, _ = forward_logprobs(trainer.backend.model, ids, mask)
    state = {n: p.detach() for n, p in trainer.backend.model.named_parameters()}
    ref_logp, _ = forward_logprobs(dequantized_model(tiny_model_dir, "nvfp4", state), ids, mask)
    assert torch.allclose(logp, ref_logp, atol=1e-6, rtol=0)


def test_bad_quantization_settings_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"trainer.quantization = 'fp6' is not a format; choose none or one of fp8"):
        build(TrainerConfig, {"quantization": "fp6"}).validate()
    with pytest.raises(ConfigError, match=r"set trainer.lora.rank = 0"):
        build(TrainerConfig, {"quantization": "fp8", "lora": {"rank": 4}}).validate()
    build(TrainerConfig, {"quantization": "int4_asym"}).validate()


@pytest.mark.slow
def test_sharded_qat_gives_the_one_rank_gradient(tiny_model_dir, tmp_path):
    """Under FSDP each Linear quantizes its full (all-gathered) weight, so two data-parallel ranks train
    exactly the policy one rank does: the step's gradient matches."""
    from tests.unit.trainer.test_parallel import ALGO, assert_same_grads, run_cases

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run_cases(tmp_path / "one", 1, [
        {"name": "qat", "model": tiny_model_dir, "trainer": {"algorithm": ALGO, "quantization": "nvfp4"}}])
    two = run_cases(tmp_path / "two", 2, [
        {"name": "qat", "model": tiny_model_dir,
         "trainer": {"algorithm": ALGO, "quantization": "nvfp4", "micro_batch_size": 1}}])
    assert_same_grads(two["qat"]["grads"], one["qat"]["grads"], "2-rank nvfp4 QAT vs 1 rank")
