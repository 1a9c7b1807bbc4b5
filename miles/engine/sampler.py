"""Next-token sampling for a batch of rows, each with its own sampling parameters.

Logprob convention (shared with the trainer, which recomputes it teacher-forced): the logprob of a
sampled token is taken from log_softmax(logits / T) in float32 for temperature T > 0, and from
log_softmax(logits) when T == 0 (greedy), always BEFORE top-k / top-p / min-p truncation. Truncation
only changes which tokens can be drawn, never the reported logprob, so the trainer does not need to
know the truncation settings to reproduce it.

Truncation order (as in SGLang): top-k, then top-p over the top-k survivors, then min-p.

A seeded row's uniforms come from its own generator (SeededDraws), drawn a block at a time: torch's
cpu uniform kernel draws element after element from the generator, so a block of k is exactly the
next k single draws, and one call per block replaces one per step.

Non-goal: penalties (frequency, presence, repetition) and logit bias.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.engine_api.sampling import SamplingParams

if TYPE_CHECKING:  # torch loads lazily so `miles serve --help` answers at once
    import torch


# Uniforms a seeded row draws at once; a row that finishes early wastes at most this many draws.
DRAW_BLOCK = 32


class SeededDraws:
    """A seeded row's uniforms in order: its generator's single draws, taken a block at a time."""

    def __init__(self, seed: int):
        import torch

        self.generator = torch.Generator().manual_seed(seed)
        self._block: list[float] = []
        self._next = 0

    def next(self) -> float:
        if self._next == len(self._block):
            import torch

            self._block, self._next = torch.rand(DRAW_BLOCK, generator=self.generator).tolist(), 0
        self._next += 1
        return self._block[self._next - 1]


def sample(
    logits: torch.Tensor,  # (B, V), any float dtype
    params: list[SamplingParams],
    generators: list[SeededDraws | torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (token ids (B,), their logprobs (B,) in float32).

    Rows with their own generator draw only from it, and draw exactly once per call, so a seeded
    request produces the same tokens whatever else shares its batch.
    """
    batch = SamplingBatch(params, logits.device)
    return batch.sample(logits, batch.uniforms(generators, default_generator))


class SamplingBatch:
    """A batch's sampling parameters as device tensors, built once for as long as the batch's rows stay
    the same, so a step's sampling runs on the device with no host round trip but the uniforms' copy."""

    def __init__(self, params: list[SamplingParams], device):
        import torch

        self.params = params
        self.sampled = [i for i, p in enumerate(params) if not p.greedy]
        self.truncates = any(0 < params[i].top_k or params[i].top_p < 1.0 or params[i].min_p > 0.0
                             for i in self.sampled)
        host = torch.tensor([[p.temperature if p.temperature > 0 else 1.0 for p in params],
                             [0.0 if p.greedy else 1.0 for p in params]], dtype=torch.float32)
        self.temps, sampled = host.to(device)
        self.greedy = sampled == 0  # (B,)
        if self.truncates:
            self.top_k = torch.tensor([p.top_k for p in params], device=device)
            self.top_p = torch.tensor([p.top_p for p in params], device=device)
            self.min_p = torch.tensor([p.min_p for p in params], device=device)

    def uniforms(self, generators: list[SeededDraws | torch.Generator | None],
                 default_generator: torch.Generator) -> torch.Tensor:
        """One uniform per sampled row (0 for greedy rows), on the host: a seeded row takes its uniform from
        its own generator (one draw per call, whatever the batch), the others share one draw from the
        engine generator. Generators live on the host, so a seed draws the same uniforms on every device."""
        import torch

        u = [0.0] * len(self.params)  # Python floats hold float32 draws exactly; one tensor built at the end
        shared = [i for i in self.sampled if generators[i] is None]
        if shared:
            for i, x in zip(shared, torch.rand(len(shared), generator=default_generator).tolist()):
                u[i] = x
        for i in self.sampled:
            g = generators[i]
            if isinstance(g, SeededDraws):
                u[i] = g.next()
            elif g is not None:
                u[i] = torch.rand(1, generator=g).item()
        return torch.tensor(u, dtype=torch.float32)

    def sample(self, logits: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (B,) and their logprobs (B,) for logits (B, V) and host uniforms `u` (B,)."""
        import torch

        logits = logits.float()
        logprobs_all = torch.log_softmax(logits / self.temps[:, None], dim=-1)  # (B, V)
        # Greedy rows take the argmax; a batch without any skips it (the draw replaces every row's).
        every_row_draws = bool(self.sampled) and len(self.sampled) == len(self.params)
        tokens = None if every_row_draws else logits.argmax(dim=-1)
        if self.sampled:
            # Pinned, so the copy does not wait for the device; a fresh pinned block per step (torch's host
            # allocator reuses it only once the copy is done), as the next step's uniforms may be drawn
            # before this copy has run.
            u = u.pin_memory().to(logits.device, non_blocking=True) if logits.is_cuda else u.to(logits.device)
            probs = logprobs_all.exp()
            if self.truncates:
                probs = _truncate(probs, self.top_k, self.top_p, self.min_p)  # (B, V)
            # Inverse-CDF sampling with one uniform per row, so the whole batch is drawn in one step;
            # strictly below the total mass, so the draw never lands on a zero-probability tail token.
            cdf = probs.cumsum(dim=-1)  # (B, V)
            target = (u * cdf[:, -1] * (1 - 1e-6))[:, None]
            drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)
            tokens = drawn if tokens is None else torch.where(self.greedy, tokens, drawn)
        token_logprobs = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
        return tokens, token_logprobs


def _truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p (per-row (B,) tensors; top_k <= 0 keeps all);
    the inverse-CDF draw renormalises the rest."""
    import torch

    vocab = probs.shape[-1]
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None]
    keep = ranks < k
    sorted_probs = sorted_probs * keep
    # Mass strictly before each token; the most likely token is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= mass_before < top_p[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True
    out = torch.zeros_like(probs)
    out.scatter_(1, sorted_idx, sorted_probs * keep)
    return out
