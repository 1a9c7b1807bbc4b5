"""miles' GRPO step computes the gradient of TRL's GRPOTrainer loss on the same batch.

The batch: two prompts of different lengths, eight sampled completions each (ragged, some ending in
EOS), plus a group whose rewards are all equal. TRL's side is its own `GRPOTrainer._compute_loss`
(loss_type dapo, beta 0, one iteration: the ratio is 1) on left-padded prompts and right-padded
completions, advantages as TRL forms them (group mean, sample std + 1e-4). miles' side is its trainer
(fsdp backend, one rank, shared prompts) on `sequences_from_groups`, with and without the
zero-variance filter. The two gradients point the same way; their norms differ by what the two
normalisations differ by: sqrt(n / (n - 1)) (population against sample std) and, with the filter, the
token count of the dropped group in the denominator. Non-goal: optimizer steps (AdamW is torch's on
both sides).
"""

from __future__ import annotations

import math
import statistics

import pytest

pytest.importorskip("trl")

from miles.net import free_port  # noqa: E402

N = 8


def _groups(model, eos: int):
    """Three groups of sampled completions: two with mixed rewards, one all equal."""
    import torch

    from miles.buffer.types import Group, Sample

    torch.manual_seed(0)
    groups = []
    for prompt, rewards in (([5, 9, 13, 17, 21, 25, 29], [1, 0, 0, 1, 0, 0, 0, 1]),
                            ([40, 41, 42], [0, 1, 1, 1, 0, 1, 1, 1]),
                            ([7, 8, 9, 10, 11], [1] * N)):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt] * N), do_sample=True, max_new_tokens=12, top_k=0,
                                 pad_token_id=eos, eos_token_id=eos, attention_mask=torch.ones(N, len(prompt)))
        samples = []
        for k, row in enumerate(out[:, len(prompt):].tolist()):
            response = row[:row.index(eos) + 1] if eos in row else row
            response = response[:3 + k]  # ragged on purpose, whether or not the model stopped
            # The engine's logprobs are the policy's own here (ratio 1, as TRL's detached old logprobs).
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
            logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0].tolist()
            samples.append(Sample(prompt_ids=list(prompt), response_ids=response, rollout_logprobs=logprobs,
                                  loss_mask=[1] * len(response), reward=float(rewards[k])))
        groups.append(Group(samples=samples))
    return groups


def _trl_gradient(model_dir, groups, tmp_path):
    """The gradient of TRL's own loss on the batch, as a flat vector in named_parameters order."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [s for g in groups for s in g.samples]
    cfg = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, per_device_train_batch_size=len(rows),
                     num_generations=N, max_completion_length=16, beta=0.0, loss_type="dapo", epsilon=0.2,
                     epsilon_high=0.2, scale_rewards="group", num_iterations=1, report_to="none",
                     disable_dropout=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=cfg,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * len(rows)), processing_class=tok)
    P = max(len(s.prompt_ids) for s in rows)
    C = max(len(s.response_ids) for s in rows)
    pad = tok.pad_token_id
    advantages = []
    for g in groups:
        mean, std = statistics.fmean(g.rewards), statistics.stdev(g.rewards)
        advantages += [(r - mean) / (std + 1e-4) for r in g.rewards]
    completion_mask = torch.tensor([[1] * len(s.response_ids) + [0] * (C - len(s.response_ids)) for s in rows])
    inputs = {
        "prompt_ids": torch.tensor([[pad] * (P - len(s.prompt_ids)) + s.prompt_ids for s in rows]),
        "prompt_mask": torch.tensor([[0] * (P - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in rows]),
        "completion_ids": torch.tensor([s.response_ids + [pad] * (C - len(s.response_ids)) for s in rows]),
        "completion_mask": completion_mask,
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "num_items_in_batch": completion_mask.sum(),
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad()
    trainer._compute_loss(trainer.model, inputs).backward()
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def _miles_gradient(model_dir, groups):
    from miles.config.loader import build
    from miles.trainer.batching import sequences_from_groups
    from miles.trainer.config import TrainerConfig
    from miles.trainer.trainer import Trainer
    from miles.trainer.types import BatchTotals

    trainer = Trainer(build(TrainerConfig, {"lr": 3e-4}), model_dir, 0, 1, "127.0.0.1", free_port())
    assert trainer.backend.shares_prompts
    seqs = sequences_from_groups(groups, trainer.algorithm)
    trainer.compute_gradients(seqs, BatchTotals.of(seqs))
    grads = {}
    for name, p in trainer.backend.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.replace("_fsdp_wrapped_module.", "")] = g
    return grads


def test_miles_grpo_is_trls_grpo_gradient_on_the_same_batch(gloo, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    groups = _groups(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), eos)
    trl = _trl_gradient(tiny_model_dir, groups, tmp_path)
    all_tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
    for label, kept in (("every group", groups), ("nonzero_std", groups[:2])):
        miles = _miles_gradient(tiny_model_dir, kept)
        assert set(miles) == set(trl), label
        a = torch.cat([trl[n].flatten() for n in sorted(trl)])
        b = torch.cat([miles[n].flatten() for n in sorted(trl)])
        assert a.norm() > 0
        cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        kept_tokens = sum(len(s.response_ids) for g in kept for s in g.samples)
        expected_ratio = math.sqrt(N / (N - 1)) * all_tokens / kept_tokens
        assert cos > 1 - 1e-5, (label, cos)
        assert (b.norm() / a.norm()).item() == pytest.approx(expected_ratio, rel=2e-3), label
