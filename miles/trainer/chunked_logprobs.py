"""Logprobs (and entropy) of given tokens from a micro-batch's logits, a chunk of tokens at a time.

The plain way, log_softmax(logits.float()) then a gather, materialises a float32 copy of the whole
(tokens x vocabulary) logits and keeps a second one for the backward: at 4k tokens of a 150k
vocabulary that is 2.4 GB each, more than the model's activations. Here the forward upcasts one chunk
of rows at a time, keeps only each row's logsumexp (and entropy), and the backward recomputes the
softmax per chunk and writes the logits' gradient in their own dtype. Numbers: the same convention
as the engine (sampler.py): log softmax(logits / T) in float32; equal to the plain way within float32
rounding, gradients too.

Non-goal: fusing the LM head's matmul into the chunks (the logits are the model's output here).
"""

from __future__ import annotations

import torch

# Rows upcast at once: 1024 x 152k float32 is about 600 MB, a fraction of any micro-batch's activations.
DEFAULT_CHUNK = 1024


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature: float, chunk: int, with_entropy: bool):
        N = logits.shape[0]  # logits (N, V), targets (N,)
        logp = torch.empty(N, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        for a in range(0, N, chunk):
            x = _tempered(logits[a:a + chunk], temperature)  # (n, V) float32
            lse_c = torch.logsumexp(x, dim=-1)
            lse[a:a + chunk] = lse_c
            logp[a:a + chunk] = x.gather(1, targets[a:a + chunk, None])[:, 0] - lse_c
            if with_entropy:
                p = torch.exp(x - lse_c[:, None])
                entropy[a:a + chunk] = lse_c - (p * x).sum(-1)
        ctx.save_for_backward(logits, targets, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return (logp, entropy) if with_entropy else (logp, torch.zeros(0, device=logits.device))

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        use_entropy = ctx.with_entropy and grad_entropy is not None and grad_entropy.numel()
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[0], chunk):
            x = _tempered(logits[a:a + chunk], T)
            logp_all = x - lse[a:a + chunk, None]
            p = torch.exp(logp_all)
            g_lp = grad_logp[a:a + chunk, None]
            # d logp_t / dx = onehot(t) - p;  d H / dx = -p (log p + H)
            g = -p * g_lp
            g.scatter_add_(1, targets[a:a + chunk, None], g_lp)
            if use_entropy:
                g -= p * (logp_all + entropy[a:a + chunk, None]) * grad_entropy[a:a + chunk, None]
            if T > 0 and T != 1.0:
                g /= T
            grad[a:a + chunk] = g.to(grad.dtype)
        return grad, None, None, None, None


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float()
    return x / temperature if temperature > 0 and temperature != 1.0 else x


def token_logprobs_chunked(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                           with_entropy: bool = False, chunk: int = DEFAULT_CHUNK):
    """logits (..., V), targets (...): the targets' logprobs (...) in float32 at `temperature` and, if
    asked, the entropy (...) of the same distribution (else None)."""
    shape = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    logp, entropy = _TokenLogprobs.apply(flat, targets.reshape(-1), temperature, chunk, with_entropy)
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)
