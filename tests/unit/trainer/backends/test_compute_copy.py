"""One bfloat16 rank trained through compute copies gets FSDP2's mixed-precision numerics: the same
gradients and the same float32 master weights after AdamW steps over several micro-batches, and
between steps every reader sees the float32 master weights."""

from __future__ import annotations

import torch

from miles.models.loading import load_model
from miles.trainer.backends.compute_copy import ComputeCopy
from miles.trainer.backends.fsdp import _shard
from miles.trainer.device import mixed_precision
from miles.trainer.forward import forward_logprobs


def _steps(model, before_forward, after_backward, before_step, steps: int = 2):
    """AdamW steps of two micro-batches each; returns the gradients of the last step before it stepped."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    grads = {}
    for _ in range(steps):
        for _ in range(2):
            ids = torch.randint(5, 200, (2, 10), generator=g)
            before_forward()
            logp, _ = forward_logprobs(model, ids, torch.ones_like(ids))
            (-logp.float().mean()).backward()
            after_backward()
        before_step()
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_compute_copies_match_fsdp2_mixed_precision_on_one_rank(tiny_model_dir, gloo):
    fsdp_model = load_model(tiny_model_dir, "float32").train()
    _shard(fsdp_model, 1, torch.device("cpu"), mixed_precision("bfloat16"))
    nothing = lambda: None  # noqa: E731
    want = _steps(fsdp_model, nothing, nothing, nothing)

    model = load_model(tiny_model_dir, "float32").train()
    copy = ComputeCopy(model, torch.bfloat16)
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: seen.append(m.weight.dtype))
    got = _steps(model, copy.to_compute, copy.accumulate, copy.to_master)
    hook.remove()

    assert seen and set(seen) == {torch.bfloat16}  # the forward computed with bfloat16 weights
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-4, msg=name)
    final = {n: _full(p).detach() for n, p in fsdp_model.named_parameters()}
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32  # between steps: the master weights
        torch.testing.assert_close(p.detach(), final[name], atol=1e-6, rtol=1e-5, msg=name)
