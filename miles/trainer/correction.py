"""Off-policy correction between the rollout policy and the policy being trained.

Rollout logprobs come from the engine: older weights (async staleness), a different numeric path
(bf16 kernels, batching), or both. With correction on, the clipped surrogate runs against the
proximal policy and each token is weighted by w = π_prox / π_rollout. With one optimizer update per
step the proximal policy is the one being trained; with `trainer.minibatches_per_step` > 1 it is the
weights at the start of the step, which the trainer records:
  truncate: w clipped into [tis_clip_low, tis_clip_high] (truncated importance sampling);
  mask:     w kept inside that band and set to 0 outside it (masked importance sampling), so tokens
            whose policies disagree a lot are dropped rather than down-weighted.
The weights carry no gradient. Reported: the signed train−rollout logprob gap and the effective
sample size of the weights, ESS = (Σw)² / (N·Σw²) ∈ (0, 1] (1 = every token counts fully).
Chosen by `trainer.algorithm.tis_mode` for any algorithm; trainer/loss.py applies it around the
algorithm's token loss. Non-goal: sequence-level weights (algorithms/seq_mis.py, decoupled_ppo.py).
"""

from __future__ import annotations

import dataclasses

import torch

from miles.trainer.algorithms.base import proximal_logprobs


def importance_weights(logprobs, rollout_logprobs, mode: str, low: float, high: float):
    """Per-token weights (no gradient) and the indicator of tokens the bounds changed. All (B, T-1)."""
    with torch.no_grad():
        # Clamp the log-ratio before exp: one token the rollout found near-impossible must not overflow.
        ratio = torch.exp(torch.clamp(logprobs.detach() - rollout_logprobs, -20.0, 20.0))
        outside = (ratio < low) | (ratio > high)
        if mode == "truncate":
            w = torch.clamp(ratio, min=low, max=high)
        elif mode == "mask":
            w = torch.where(outside, torch.zeros_like(ratio), ratio)
        else:
            raise ValueError(f"unknown off-policy correction {mode!r}: choose off, truncate or mask")
        return w, outside.float()


def corrected_inputs(x, mode: str, low: float, high: float):
    """LossInputs whose surrogate runs against the proximal policy, plus the per-token weights
    π_prox/π_rollout (with one update per step the proximal policy is the current one)."""
    prox = proximal_logprobs(x)
    w, changed = importance_weights(prox, x.old_logprobs, mode, low, high)
    return dataclasses.replace(x, old_logprobs=prox), w, changed


def tis_sums(w: torch.Tensor, changed, logprobs, rollout_logprobs, mask) -> dict[str, float]:
    """Sums over loss tokens (to all-reduce across ranks, then `tis_metrics`)."""
    return {"tis_w": float((w * mask).sum()), "tis_w2": float((w * w * mask).sum()),
            "tis_changed": float((changed * mask).sum()),
            "tis_gap": float(((logprobs.detach() - rollout_logprobs) * mask).sum())}


def tis_metrics(red: dict[str, float], n: float) -> dict[str, float]:
    if "tis_w" not in red:
        return {}
    w, w2 = red["tis_w"], red["tis_w2"]
    return {"train/tis_weight_mean": w / n, "train/tis_clipped_frac": red["tis_changed"] / n,
            "train/tis_ess": (w * w) / (n * w2) if w2 > 0 else 0.0,
            "train/train_rollout_logprob_gap": red["tis_gap"] / n}
