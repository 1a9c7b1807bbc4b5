"""Decoupled PPO (AReaL): the clip is taken around a recent *proximal* policy, and the gap between
that proximal policy and the stale *behaviour* policy that sampled the tokens is corrected by an
importance weight, so a sample generated several versions ago neither clips away nor blows up.

Per loss token, with r = π_θ / π_prox and w = π_prox / π_behav (no gradient through w):

    loss = -w · min(r·A, clip(r, 1 - ε_low, 1 + ε_high)·A) + β · ½(log π_θ − log π_behav)²
    w := 0 where w > behav_weight_cap,   β = behav_kl_coef (default 1; 0 = AReaL's objective)

The proximal policy is the trainer's weights at the start of the step. With one optimizer update per
step (`trainer.minibatches_per_step = 1`) those are the weights of the training forward, so
`log π_prox = log π_θ` detached, exact and free; r = 1 in value, the clip never binds, and the
objective's effect is the capped behaviour weight (AReaL's behaviour with one minibatch). With k > 1
minibatches the trainer records every sequence's logprobs under those weights in one no-grad forward
before the first update (`LossInputs.prox_logprobs`): from the second minibatch on r moves away from 1
and the clip bounds how far one step's k updates take the policy from where it started, whatever the
staleness of the samples. Approximating π_prox from recorded versions (interpolating between the
engine's logprobs and the current ones by weight version) would add error for nothing: the engine's
logprobs differ from the trainer's by numerics even at the same version. Advantages are GRPO's.

The KL penalty toward the behaviour policy is this objective's addition to AReaL's. With one update per
step the weight alone is no trust region: a batch sampled s versions ago steers the policy by where it
stood then, and at staleness 4 that loop swings and drifts (docs/algorithms.md). The penalty pulls each
token back toward the probability it was sampled at, in proportion to how far it has moved. On a
sample drawn by the weights being trained it is 0 up to the engine's numerics (a low-precision engine
leaves a pull of the size of its logprob mismatch, `train/rollout_logprob_abs_diff`).

Options for stale samples (each off by default; docs/algorithms.md has what they measured):
`sequence_weight` weights every token by its sequence's ratio, the exact correction for one reward
per response; `m2_threshold` drops the most-moved tokens until the batch's second moment of the
log-ratio is bounded (M2PO); `group_reweight` re-estimates each group's baseline and std under the
proximal policy before the step (trainer/batching.py::reweight_groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.config.loader import ConfigError
from miles.trainer.algorithms.base import (LossInputs, clipped_surrogate, kl_estimate, proximal_logprobs,
                                          sequence_sums)
from miles.trainer.algorithms.grpo import GRPO

if TYPE_CHECKING:
    import torch

# Edges of the behaviour-weight histogram reported per step (`<prefix>/behav_weight_le_<edge>`): the
# fraction of loss tokens whose weight is at most each edge. Ranks all-reduce sums, so the step reports
# this cumulative histogram rather than exact quantiles; the quantiles read off it.
WEIGHT_EDGES = (0.5, 0.8, 1.25, 2.0)


class DecoupledPPO(GRPO):
    @dataclass
    class Config(GRPO.Config):
        behav_weight_cap: float = 5.0
        """Tokens whose behaviour weight π_prox/π_behav exceeds this are dropped from the loss (0 = no cap)."""

        sequence_weight: bool = False
        """Weight every token by its sequence's π_prox(y)/π_behav(y) (the product over its loss tokens)
        rather than its own token's ratio, capped the same way: a stale response whose first tokens the
        policy has since left counts as rarely as the policy would now produce it, continuation included."""
        m2_threshold: float = 0.0
        """Second-moment trust region (M2PO): drop the tokens with the largest (log π_prox − log π_behav)²
        until the mean over the micro-batch's remaining loss tokens is at most this (e.g. 0.04; 0 = off)."""
        behav_kl_coef: float = 1.0
        """KL penalty toward the behaviour policy: add coef × ½(log π_θ − log π_behav)² per loss token (the
        k2 estimate of the KL), pulling back the tokens the policy has moved furthest since the engine
        sampled them. Zero on a sample as fresh as the weights it trains (up to the engine's numerics),
        so it acts on stale ones; 0 = AReaL's objective exactly."""
        group_reweight: bool = False
        """Centre and scale each group's rewards as the proximal policy would see them: its mean and std
        under self-normalised sequence weights π_prox(y)/π_behav(y), not the stale policy's that sampled
        them (costs one no-grad forward of the batch per step)."""

        def validate(self) -> None:
            super().validate()
            if self.m2_threshold < 0:
                raise ConfigError("trainer.algorithm.m2_threshold must be >= 0 (e.g. 0.04), or 0 for no trust region")
            if self.behav_kl_coef < 0:
                raise ConfigError("trainer.algorithm.behav_kl_coef must be >= 0 (e.g. 1.0), or 0 for no penalty")
            if self.behav_weight_cap < 0:
                raise ConfigError("trainer.algorithm.behav_weight_cap must be >= 0 (e.g. 5.0), or 0 for no cap")
            if self.tis_mode != "off":
                raise ConfigError(f"trainer.algorithm.name = {self.name!r} weights tokens against the behaviour "
                                  "policy itself: set trainer.algorithm.tis_mode = 'off'")

    cfg: Config

    @property
    def needs_proximal(self) -> bool:
        return True

    @property
    def reweights_groups(self) -> bool:
        return self.cfg.group_reweight

    def reweighted_advantages(self, rewards: list[float], log_weights: list[float]) -> list[float]:
        """A group's advantages with its baseline and std under the proximal policy.

        `log_weights` are the samples' sequence log-ratios log π_prox(y) − log π_behav(y). Normalised, the
        weights estimate the group's mean reward and spread as fresh samples would show them, so a prompt
        the policy has since learned is centred near its new success rate, as sync would centre it. The
        std is floored at that of a fresh group of this size with one sample apart (for 0/1 rewards, the
        smallest a trained group can have): a group the proximal policy would all but solve would otherwise
        divide by a near-zero spread."""
        n = len(rewards)
        if n < 2:
            return [0.0] * n
        top = max(log_weights)
        w = [math.exp(max(lw - top, -40.0)) for lw in log_weights]  # relative weights, overflow-free
        total = sum(w)
        mean = sum(wi * r for wi, r in zip(w, rewards)) / total
        centred = [r - mean for r in rewards]
        if not self.cfg.std_normalize:
            return centred
        std = math.sqrt(sum(wi * c * c for wi, c in zip(w, centred)) / total)
        floor = (max(rewards) - min(rewards)) * math.sqrt(n - 1) / n
        return [c / (max(std, floor) + 1e-6) for c in centred]

    def behaviour_weights(self, x: LossInputs, prox: "torch.Tensor"):
        """Per-token weight π_prox/π_behav after the cap, before it, and the tokens it dropped (B, T-1)."""
        import torch

        log_w = prox - x.old_logprobs  # (B, T-1)
        if self.cfg.sequence_weight:
            log_w = sequence_sums(log_w * x.mask, x.seq_ids)
        # Clamp the log-ratio before exp: a token the engine found near-impossible must not overflow.
        w = torch.exp(torch.clamp(log_w, -20.0, 20.0))
        cap = self.cfg.behav_weight_cap
        dropped = w > cap if cap > 0 else torch.zeros_like(w, dtype=torch.bool)
        return torch.where(dropped, torch.zeros_like(w), w), w, dropped

    def token_loss(self, x: LossInputs):
        import torch

        prox = proximal_logprobs(x)  # (B, T-1): the weights at the start of this step
        w, raw, dropped = self.behaviour_weights(x, prox)
        if self.cfg.m2_threshold > 0:
            outside = ~second_moment_keep(prox - x.old_logprobs, x.mask, self.cfg.m2_threshold)
            w = torch.where(outside, torch.zeros_like(w), w)
            dropped = dropped | outside
        loss, clipped = clipped_surrogate(x.logprobs, prox, x.advantages, self.clip_low, self.clip_high,
                                          self.cfg.dual_clip_c)
        k2 = kl_estimate(x.logprobs, x.old_logprobs, "k2")  # ½(log π_θ − log π_behav)², per token
        loss = loss * w + self.cfg.behav_kl_coef * k2
        p = "decoupled_ppo"  # its own metrics, next to the shared train/ ones
        metrics = {f"{p}/behav_kl": k2.detach(), "clipfrac": clipped, f"{p}/clipped_frac_ratio": clipped,
                   f"{p}/clipped_frac_weight_cap": dropped.float(), f"{p}/behav_weight_mean": raw}
        metrics.update(weight_histogram(p, raw))
        return loss, metrics


def second_moment_keep(log_ratio: "torch.Tensor", mask: "torch.Tensor", threshold: float) -> "torch.Tensor":
    """(B, T-1) tokens to keep: all but the loss tokens of largest squared log-ratio, dropped largest
    first until the mean squared log-ratio of the kept ones is at most `threshold`. Dropping the few
    tokens the policy moved most, rather than clipping each, bounds how far the batch as a whole
    steps from the behaviour policy (M2PO)."""
    import torch

    m2 = (log_ratio.detach() ** 2).masked_fill(mask <= 0, 0.0)
    vals = m2[mask > 0]  # (N,)
    order = torch.argsort(vals)
    prefix_mean = torch.cumsum(vals[order], 0) / torch.arange(1, len(vals) + 1, device=vals.device)
    n_keep = int((prefix_mean <= threshold).sum())  # prefix means rise with each larger value added
    keep_flat = torch.zeros_like(vals, dtype=torch.bool)
    keep_flat[order[:n_keep]] = True
    keep = torch.ones_like(m2, dtype=torch.bool)
    keep[mask > 0] = keep_flat
    return keep


def weight_histogram(prefix: str, w: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """Per-token indicators of w <= each edge; their token means form the cumulative histogram."""
    return {f"{prefix}/behav_weight_le_{edge:g}": (w <= edge).float() for edge in WEIGHT_EDGES}
