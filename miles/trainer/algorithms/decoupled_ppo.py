"""Decoupled PPO (AReaL): the clip is taken around a recent *proximal* policy, and the gap between
that proximal policy and the stale *behaviour* policy that sampled the tokens is corrected by an
importance weight, so a sample generated several versions ago neither clips away nor blows up.

Per loss token, with r = π_θ / π_prox and w = π_prox / π_behav (no gradient through w):

    loss = -w · min(r·A, clip(r, 1 - ε_low, 1 + ε_high)·A),   w := 0 where w > behav_weight_cap

The proximal logprobs are the trainer's own, computed at collect time by the policy that is about to
be updated: a step runs one optimizer update per rollout batch, so the weights of the training
forward *are* the proximal policy and `log π_prox = log π_θ` detached, exact and free (no extra
forward). Approximating them from recorded versions (interpolating between the engine's behaviour
logprobs and the current ones by weight version) would add error for nothing here, and the engine's
logprobs differ from the trainer's by numerics even at the same version. Consequence worth knowing:
with one update per batch, r = 1 in value, so the clip never binds; the objective's effect is the
capped behaviour weight (AReaL's behaviour with one minibatch). Advantages are GRPO's.
Non-goal: several updates per batch (the loss core's non-goal), where the clip would start to bind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.config.loader import ConfigError
from miles.trainer.algorithms.base import LossInputs, clipped_surrogate
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

        def validate(self) -> None:
            super().validate()
            if self.behav_weight_cap < 0:
                raise ConfigError("trainer.algorithm.behav_weight_cap must be >= 0 (e.g. 5.0), or 0 for no cap")
            if self.tis_mode != "off":
                raise ConfigError(f"trainer.algorithm.name = {self.name!r} weights tokens against the behaviour "
                                  "policy itself: set trainer.algorithm.tis_mode = 'off'")

    cfg: Config

    def behaviour_weights(self, x: LossInputs, prox: "torch.Tensor"):
        """Per-token weight π_prox/π_behav after the cap, before it, and the tokens it dropped (B, T-1)."""
        import torch

        # Clamp the log-ratio before exp: a token the engine found near-impossible must not overflow.
        w = torch.exp(torch.clamp(prox - x.old_logprobs, -20.0, 20.0))
        cap = self.cfg.behav_weight_cap
        dropped = w > cap if cap > 0 else torch.zeros_like(w, dtype=torch.bool)
        return torch.where(dropped, torch.zeros_like(w), w), w, dropped

    def token_loss(self, x: LossInputs):
        prox = x.logprobs.detach()  # (B, T-1): the proximal policy is the policy before this step's update
        w, raw, dropped = self.behaviour_weights(x, prox)
        loss, clipped = clipped_surrogate(x.logprobs, prox, x.advantages, self.clip_low, self.clip_high,
                                          self.cfg.dual_clip_c)
        p = "decoupled_ppo"  # its own metrics, next to the shared train/ ones
        metrics = {"clipfrac": clipped, f"{p}/clipped_frac_ratio": clipped,
                   f"{p}/clipped_frac_weight_cap": dropped.float(), f"{p}/behav_weight_mean": raw}
        metrics.update(weight_histogram(p, raw))
        return loss * w, metrics


def weight_histogram(prefix: str, w: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """Per-token indicators of w <= each edge; their token means form the cumulative histogram."""
    return {f"{prefix}/behav_weight_le_{edge:g}": (w <= edge).float() for edge in WEIGHT_EDGES}
