"""Shared prompts (trainer.share_prompts): a micro-batch carries each distinct prompt once and its rows
from the prompt's last token on; the two-pass forward gives each response token the logprob of the
whole sequence's forward. Real tiny model; the gradient side is in test_parallel.py."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.trainer.batching import build_micro_batch, shareable_prompts
from miles.trainer.forward import logprobs_from_logits, shared_prompt_logits, shares_prompt_kv
from miles.trainer.types import TrainSequence


def _groups(rng: random.Random, uniform: bool) -> list[TrainSequence]:
    seqs = []
    for _ in range(3):
        prompt = [rng.randint(5, 300) for _ in range(7 if uniform else rng.randint(3, 9))]
        for _ in range(4):
            n = 4 if uniform else rng.randint(1, 6)
            seqs.append(TrainSequence(tokens=prompt + [rng.randint(5, 300) for _ in range(n)], prompt_len=len(prompt),
                                      loss_mask=[1] * n, old_logprobs=[-1.0] * n, advantage=1.0))
    return seqs


@pytest.mark.parametrize("uniform", [True, False], ids=["same_lengths", "mixed_lengths"])
def test_rows_on_shared_prompts_score_what_whole_sequences_score(tiny_model_dir, uniform):
    # Same lengths: no padding anywhere, so no mask entry is zero (the case where a causal-mask shortcut
    # with fewer queries than keys would misalign). Mixed: prompts right-padded, rows too.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    seqs = _groups(random.Random(1), uniform)
    weights = [1.0] * len(seqs)
    whole = build_micro_batch(seqs, weights, False, 0)
    rows = build_micro_batch(seqs, weights, False, 0, share_prompts=True)
    assert rows.shared is not None and rows.shared.input_ids.shape[0] == 3  # each prompt once
    assert bool(rows.attention_mask.all()) == uniform
    with torch.no_grad():
        want, _ = logprobs_from_logits(model(input_ids=whole.input_ids, attention_mask=whole.attention_mask).logits,
                                       whole.input_ids)
        got, _ = logprobs_from_logits(shared_prompt_logits(model, rows), rows.input_ids)
    # Response tokens in the same order (row-major), each scored alike.
    assert torch.equal(whole.seq_ids[whole.mask > 0], rows.seq_ids[rows.mask > 0])
    assert (want[whole.mask > 0] - got[rows.mask > 0]).abs().max() < 1e-5
    assert torch.equal(whole.old_logprobs[whole.mask > 0], rows.old_logprobs[rows.mask > 0])


def test_prompts_are_shared_only_when_one_repeats_and_the_family_keeps_plain_kv(tiny_model_dir):
    seqs = _groups(random.Random(2), uniform=False)
    assert shareable_prompts(seqs)
    assert not shareable_prompts(seqs[::4])  # one sample per prompt: nothing to share
    one_token = [TrainSequence(tokens=[7, 8, 9], prompt_len=1, loss_mask=[1, 1], old_logprobs=[0.0, 0.0])] * 2
    assert not shareable_prompts(one_token)  # no token before the prompt's last
    config = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config
    assert shares_prompt_kv(config)
    config.use_sliding_window, config.sliding_window = True, 16
    assert not shares_prompt_kv(config)  # a window counts slots, and a padded prompt shifts them
