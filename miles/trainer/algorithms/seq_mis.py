"""Sequence-level masked importance sampling: the whole sequence is kept or dropped by its
importance weight against the behaviour policy, rather than each token on its own.

For a sequence of loss tokens t with proximal logprobs (the trainer's, as in decoupled_ppo.py) and
the behaviour policy's (the engine's), the log-weight is

    log ρ = Σ_t (log π_prox − log π_behav)         (geometric = true: the mean over t instead)

and every token of the sequence is weighted by ρ when seq_is_low <= ρ <= seq_is_high, by 0 otherwise,
on the clipped surrogate around the proximal policy. A token-level weight lets a sequence that drifted
far keep its few unremarkable tokens; judging the sequence as a whole drops it entirely, which is
the point for stale or mismatched samples whose errors compound along the response. The product
grows with length, so long responses leave the band sooner; the geometric mean is length-free.
Advantages are GRPO's. Non-goal: truncating ρ (large ρ is dropped, not capped).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.loader import ConfigError
from miles.trainer.algorithms.base import LossInputs, clipped_surrogate, proximal_logprobs, sequence_sums
from miles.trainer.algorithms.decoupled_ppo import weight_histogram
from miles.trainer.algorithms.grpo import GRPO


class SeqMIS(GRPO):
    @dataclass
    class Config(GRPO.Config):
        seq_is_low: float = 0.5
        """A sequence whose importance weight ρ = π_prox/π_behav is below this is dropped."""
        seq_is_high: float = 2.0
        """A sequence whose importance weight is above this is dropped."""
        geometric: bool = False
        """ρ from the mean per-token log-ratio (length-free) instead of the sum (the product of ratios)."""

        def validate(self) -> None:
            super().validate()
            if not 0 <= self.seq_is_low < 1 < self.seq_is_high:
                raise ConfigError("trainer.algorithm: need 0 <= seq_is_low < 1 < seq_is_high (e.g. 0.5 and 2.0)")
            if self.tis_mode != "off":
                raise ConfigError("trainer.algorithm.name = 'seq_mis' weights sequences against the behaviour "
                                  "policy itself: set trainer.algorithm.tis_mode = 'off'")

    cfg: Config

    @property
    def needs_proximal(self) -> bool:
        return True

    def sequence_weights(self, x: LossInputs, prox):
        """ρ of each token's sequence (B, T-1), 0 where the sequence is dropped; the raw ρ; the dropped tokens."""
        import torch

        sums = sequence_sums((prox - x.old_logprobs) * x.mask, x.seq_ids)  # (B, T-1)
        if self.cfg.geometric:
            sums = sums / sequence_sums(x.mask, x.seq_ids).clamp(min=1.0)
        rho = torch.exp(torch.clamp(sums, -20.0, 20.0))
        dropped = (rho < self.cfg.seq_is_low) | (rho > self.cfg.seq_is_high)
        return torch.where(dropped, torch.zeros_like(rho), rho), rho, dropped

    def token_loss(self, x: LossInputs):
        prox = proximal_logprobs(x)  # (B, T-1): the weights at the start of this step (see decoupled_ppo.py)
        w, rho, dropped = self.sequence_weights(x, prox)
        loss, clipped = clipped_surrogate(x.logprobs, prox, x.advantages, self.clip_low, self.clip_high,
                                          self.cfg.dual_clip_c)
        p = "seq_mis"  # its own metrics, next to the shared train/ ones
        metrics = {"clipfrac": clipped, f"{p}/clipped_frac_ratio": clipped,
                   f"{p}/masked_frac_seq_weight": dropped.float(), f"{p}/seq_weight_mean": rho}
        metrics.update(weight_histogram(p, rho))
        return loss * w, metrics
