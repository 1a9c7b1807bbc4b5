"""Packed rows attend a sequence at a time (trainer/packed_attention.py): the same logits and gradients
as each sequence alone and as transformers' masked packed path, without building the N x N mask.
Real tiny models of each served family; the FSDP backend's packed training is checked against
unpacked training in test_parallel.py (its `packed` and `dp_packed` cases run this path)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config
import transformers.masking_utils as masking_utils

from miles.trainer import packed_attention
from miles.trainer.packed_attention import Plan

LENGTHS = [37, 5, 12, 60, 1, 9, 44, 23, 23, 7, 2, 31]


def _small(config_cls, **window):
    config = config_cls(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **window)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


@pytest.fixture(params=["qwen3", "qwen3_moe", "llama", "mistral", "qwen2"])
def model(request, tiny_model_dir, tiny_moe_model_dir):
    if request.param in ("qwen3", "qwen3_moe"):
        path = tiny_model_dir if request.param == "qwen3" else tiny_moe_model_dir
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    if request.param == "mistral":
        return _small(MistralConfig, sliding_window=None)  # Mistral's config windows 4096 tokens by default
    return _small({"llama": LlamaConfig, "qwen2": Qwen2Config}[request.param])


def _packed(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 320, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, pos


def _grads(model, logits):
    model.zero_grad()
    (logits.float() ** 2).mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_planned_packed_row_scores_and_trains_each_sequence_as_its_own_forward(model):
    ids, pos = _packed(LENGTHS)
    model.train()
    masked = model(input_ids=ids, position_ids=pos, use_cache=False).logits  # transformers' N x N mask
    want_grads = _grads(model, masked)
    with torch.no_grad():
        alone, start = [], 0
        for n in LENGTHS:
            alone.append(model(input_ids=ids[:, start:start + n], use_cache=False).logits)
            start += n
        alone = torch.cat(alone, dim=1)
    assert packed_attention.enable(model)
    got = packed_attention.logits(model, ids, pos, Plan.of(LENGTHS))
    assert got.shape == masked.shape
    assert (got - alone).abs().max() < 1e-5
    assert (got - masked).abs().max() < 1e-5
    for g, w in zip(_grads(model, got), want_grads, strict=True):
        assert (g - w).abs().max() <= 1e-5 * max(1.0, w.abs().max().item())


def test_a_planned_forward_builds_no_mask_and_every_other_forward_gets_sdpas(tiny_model_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa", dtype=torch.float32)
    calls = []
    real = masking_utils.sdpa_mask
    monkeypatch.setattr(masking_utils, "sdpa_mask", lambda *a, **k: calls.append(1) or real(*a, **k))
    padded = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        before = model(input_ids=padded, attention_mask=attn, use_cache=False).logits
        assert packed_attention.enable(model)
        calls.clear()
        ids, pos = _packed(LENGTHS)
        packed_attention.logits(model, ids, pos, Plan.of(LENGTHS))
        assert calls == []
        after = model(input_ids=padded, attention_mask=attn, use_cache=False).logits
    assert calls  # a padded batch still gets SDPA's padding mask
    assert torch.equal(before, after)


def test_the_plan_places_every_position_once_and_at_most_doubles_a_batchs_attention():
    rng = random.Random(3)
    for lengths in (LENGTHS, [1], [4] * 9, [rng.randint(1, 300) for _ in range(100)]):
        plan = Plan.of(lengths)
        n = sum(lengths)
        placed = torch.cat([g.flatten()[k] for g, k in zip(plan.gathers, plan.keeps)])
        assert sorted(placed.tolist()) == list(range(n))
        assert torch.equal(placed[plan.order], torch.arange(n))
        for g, k in zip(plan.gathers, plan.keeps):
            rows, width = g.shape
            real = (k // width).bincount(minlength=rows)  # each member's length
            assert int(real.max()) == width
            assert rows * width ** 2 <= 2 * int((real ** 2).sum())
        assert len(plan.gathers) <= math.ceil(2 * math.log2(max(lengths))) + 1


def test_plans_refuse_what_they_cannot_lay_out(tiny_model_dir):
    with pytest.raises(ValueError, match="at least one token"):
        Plan.of([3, 0, 2])
    with pytest.raises(ValueError, match="at least one token"):
        Plan.of([])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa", dtype=torch.float32)
    assert packed_attention.enable(model)
    ids = torch.randint(1, 320, (2, 6))
    with pytest.raises(ValueError, match="one row"):
        packed_attention.logits(model, ids, torch.arange(6).expand(2, 6), Plan.of([6]))


def test_models_it_cannot_serve_keep_transformers_attention(tiny_model_dir):
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert "not sdpa" in packed_attention.serves(eager)
    assert not packed_attention.enable(eager)
    assert eager.config._attn_implementation == "eager"
    windowed = _small(MistralConfig, sliding_window=16)
    assert "sliding" in packed_attention.serves(windowed)
    assert not packed_attention.enable(windowed)
    assert windowed.config._attn_implementation == "sdpa"


def test_the_reference_and_teacher_score_a_packed_micro_batch_by_its_plan(tiny_model_dir):
    from miles.trainer.batching import build_micro_batch
    from miles.trainer.reference import ReferenceModel
    from miles.trainer.types import TrainSequence

    rng = random.Random(5)
    seqs = []
    for n in LENGTHS:
        prompt = [rng.randint(5, 300) for _ in range(4)]
        seqs.append(TrainSequence(tokens=prompt + [rng.randint(5, 300) for _ in range(n)], prompt_len=4,
                                  loss_mask=[1] * n, old_logprobs=[-1.0] * n, advantage=1.0))
    packed = build_micro_batch(seqs, [1.0] * len(seqs), True, 0)
    padded = build_micro_batch(seqs, [1.0] * len(seqs), False, 0)
    assert packed.packed is not None and padded.packed is None
    ref = ReferenceModel(tiny_model_dir)  # the in-trainer teacher is one too
    assert packed_attention.active(ref.model)
    by_plan = ref.logprobs(packed.input_ids, None, packed.position_ids, 1.0, packed=packed.packed)
    by_mask = ref.logprobs(packed.input_ids, None, packed.position_ids, 1.0)
    by_rows = ref.logprobs(padded.input_ids, padded.attention_mask, None, 1.0)
    # Loss tokens in sequence order on both layouts.
    assert torch.equal(packed.seq_ids[packed.mask > 0], padded.seq_ids[padded.mask > 0])
    assert (by_plan[packed.mask > 0] - by_rows[padded.mask > 0]).abs().max() < 1e-5
    assert (by_plan - by_mask)[packed.mask > 0].abs().max() < 1e-5


def _groups(response_lengths, prompts=4, samples=4, seed=0):
    from miles.trainer.types import TrainSequence

    rng = random.Random(seed)
    seqs = []
    for _ in range(prompts):
        prompt = [rng.randint(5, 300) for _ in range(6)]
        for _ in range(samples):
            n = rng.choice(response_lengths)
            seqs.append(TrainSequence(tokens=prompt + [rng.randint(5, 300) for _ in range(n)], prompt_len=6,
                                      loss_mask=[1] * n, old_logprobs=[-5.0] * n, advantage=rng.choice([-1.0, 1.0])))
    return seqs


def test_auto_packs_a_step_of_long_responses_shares_short_ones_and_trains_the_same(tiny_model_dir, gloo):
    from miles.config.loader import build
    from miles.net import free_port
    from miles.trainer.config import TrainerConfig
    from miles.trainer.trainer import Trainer
    from miles.trainer.types import BatchTotals

    def trainer(pack):
        return Trainer(build(TrainerConfig, {"lr": 1e-2, **({} if pack == "auto" else {"pack_sequences": pack})}),
                       tiny_model_dir, 0, 1, "127.0.0.1", free_port())

    auto, padded, packed = trainer("auto"), trainer(False), trainer(True)
    assert TrainerConfig().pack_sequences == "auto" and auto.backend.packs_by_plan
    long, short = _groups([3, 20, 40, 90]), _groups([2])
    algo = auto.algorithm
    assert auto._layout(long, algo) == (True, False)  # packed: fewer tokens than padded rows on shared prompts
    assert auto._layout(short, algo) == (False, True)  # a 6-token prompt shared by 4 two-token answers
    assert padded._layout(long, algo) == (False, True) and packed._layout(short, algo) == (True, False)
    # The same gradient (compared before an optimizer step: Adam's first step is the gradient's sign, so
    # an entry rounding near zero would differ by 2 x lr after it).
    got, want = auto.compute_gradients(long, BatchTotals.of(long)), padded.compute_gradients(long, BatchTotals.of(long))
    for key in ("train/loss", "train/nll"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    grads = {n: p.grad for n, p in auto.backend.model.named_parameters()}
    for n, p in padded.backend.model.named_parameters():
        assert (grads[n] - p.grad).abs().max() <= 1e-5 * max(1e-3, p.grad.abs().max().item()), n
