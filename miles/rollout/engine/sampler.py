"""Next-token sampling for a batch of rows, each with its own sampling parameters.

Logprob convention (shared with the trainer, which recomputes it teacher-forced): the logprob of a
sampled token is taken from log_softmax(logits / T) in float32 for temperature T > 0, and from
log_softmax(logits) when T == 0 (greedy), always BEFORE top-k / top-p / min-p truncation. Truncation
only changes which tokens can be drawn, never the reported logprob, so the trainer does not need to
know the truncation settings to reproduce it.

Truncation order (as in SGLang): top-k, then top-p over the top-k survivors, then min-p.
Non-goal: penalties (frequency, presence, repetition) and logit bias.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.engine_api.sampling import SamplingParams

if TYPE_CHECKING:  # torch loads lazily so `miles serve --help` answers at once
    import torch


def sample(
    logits: torch.Tensor,  # (B, V), any float dtype
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (token ids (B,), their logprobs (B,) in float32).

    Rows with their own generator draw only from it, and draw exactly once per call, so a seeded
    request produces the same tokens whatever else shares its batch.
    """
    import torch

    device = logits.device
    logits = logits.float()
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=torch.float32)
    logprobs_all = torch.log_softmax(logits / temps.to(device)[:, None], dim=-1)  # (B, V)

    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        idx = torch.tensor(greedy_rows, device=device)
        tokens[idx] = logits[idx].argmax(dim=-1)
    if sampled_rows:
        idx = torch.tensor(sampled_rows, device=device)
        probs = _truncate(logprobs_all[idx].exp(), [params[i] for i in sampled_rows])  # (S, V)
        # Inverse-CDF sampling with one uniform per row, so the whole batch is drawn in one vectorised
        # step: a seeded row takes its uniform from its own generator (one draw per call, whatever
        # the batch), the others share one draw from the engine generator. Generators live on the
        # host, so a seed draws the same uniforms on every device; they travel in one small copy.
        u = torch.empty(len(sampled_rows))
        shared = [j for j, i in enumerate(sampled_rows) if generators[i] is None]
        if shared:
            u[torch.tensor(shared)] = torch.rand(len(shared), generator=default_generator)
        for j, i in enumerate(sampled_rows):
            if generators[i] is not None:
                u[j] = torch.rand(1, generator=generators[i])[0]
        u = u.to(device, non_blocking=True)
        cdf = probs.cumsum(dim=-1)  # (S, V)
        # Strictly below the total mass, so the draw never lands on a zero-probability tail token.
        target = (u * cdf[:, -1] * (1 - 1e-6))[:, None]
        tokens[idx] = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)
    token_logprobs = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    return tokens, token_logprobs


def _truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p; multinomial renormalises the rest."""
    import torch

    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p) and all(m <= 0.0 for m in min_p):
        return probs
    vocab, device = probs.shape[-1], probs.device
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)  # (S, V)
    ranks = torch.arange(vocab, device=device)[None, :]
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)[:, None]
    keep = ranks < k
    sorted_probs = sorted_probs * keep
    # Mass strictly before each token; the most likely token is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= mass_before < torch.tensor(top_p, device=device)[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
    keep &= sorted_probs >= torch.tensor(min_p, device=device)[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True
    out = torch.zeros_like(probs)
    out.scatter_(1, sorted_idx, sorted_probs * keep)
    return out
