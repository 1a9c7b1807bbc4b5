"""The trainer's chunked token logprobs equal the plain log_softmax-then-gather, values and gradients,
entropy included, at any temperature, chunk size and logits dtype."""

from __future__ import annotations

import pytest
import torch

from miles.trainer.chunked_logprobs import token_logprobs_chunked
from miles.trainer.forward import logprobs_from_logits


def _plain(logits, targets, T, with_entropy):
    x = logits.float()
    x = x / T if T != 1.0 else x
    lp_all = torch.log_softmax(x, -1)
    lp = lp_all.gather(-1, targets[..., None])[..., 0]
    return lp, (-(lp_all.exp() * lp_all).sum(-1) if with_entropy else None)


@pytest.mark.parametrize("dtype,T,chunk", [(torch.float32, 1.0, 3), (torch.float32, 0.7, 64), (torch.bfloat16, 1.0, 5)])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_values_and_gradients_equal_the_plain_way(dtype, T, chunk, with_entropy):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn((2, 7, 50), generator=g) * 3).to(dtype)
    targets = torch.randint(0, 50, (2, 7), generator=g)
    w_lp, w_ent = torch.randn((2, 7), generator=g), torch.randn((2, 7), generator=g)
    grads, outs = [], []
    for fn in (lambda x: _plain(x, targets, T, with_entropy),
               lambda x: token_logprobs_chunked(x, targets, T, with_entropy, chunk=chunk)):
        x = base.clone().requires_grad_(True)
        lp, ent = fn(x)
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0)
        loss.backward()
        outs.append((lp, ent))
        grads.append(x.grad.float())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    if with_entropy:
        torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], **tol)


def test_the_trainers_logprobs_score_each_position_against_the_next_token():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn((3, 6, 20), generator=g)
    ids = torch.randint(0, 20, (3, 6), generator=g)
    lp, ent = logprobs_from_logits(logits, ids, 0.9, with_entropy=True)
    want_lp, want_ent = _plain(logits[:, :-1], ids[:, 1:], 0.9, True)
    assert lp.shape == (3, 5)
    torch.testing.assert_close(lp, want_lp)
    torch.testing.assert_close(ent, want_ent)
