"""The step's loss, composed from what the algorithm declares; the same for every backend.

The trainer (trainer/trainer.py) runs the forward passes the algorithm asks for (policy logprobs
always; entropy, reference logprobs, critic values when declared) and hands the per-token tensors
here. This module adds, in a fixed order: KL to the reference folded into the advantages
(kl_mode = reward), GAE over the critic's values (PPO, trainer/critic.py), off-policy correction
weights (trainer/correction.py), the algorithm's own token loss, the KL loss term, the entropy bonus,
and the aggregation weights; then it keeps the metric sums that ranks all-reduce. It reads an
algorithm only through the contract in algorithms/base.py. Non-goal: running models or stepping
optimizers (the backend's job).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.trainer.algorithms.base import Algorithm, LossInputs, kl_estimate, kl_reward_penalty, token_weights
from miles.trainer.batching import MicroBatch
from miles.trainer.correction import corrected_inputs, tis_metrics, tis_sums
from miles.trainer.critic import gae, value_loss
from miles.trainer.types import BatchTotals, TrainSequence

# A sampled token whose trainer and engine logprobs differ by more than this counts as mismatched
# (train/rollout_mismatch_frac); 0.1 nats is a 10% disagreement about the token's probability.
MISMATCH_THRESHOLD = 0.1


@dataclass
class ForwardOutputs:
    """What the backend's forward passes produced for one micro-batch, each (B, T-1)."""

    logprobs: torch.Tensor                     # policy, with gradient
    entropy: torch.Tensor | None = None        # when algorithm.needs_entropy
    ref_logprobs: torch.Tensor | None = None   # when algorithm.needs_reference
    values: torch.Tensor | None = None         # critic, with gradient, when algorithm.needs_critic
    teacher_logprobs: torch.Tensor | None = None  # frozen teacher, when algorithm.needs_teacher


def sequence_weights(algorithm: Algorithm, seqs: list[TrainSequence], totals: BatchTotals,
                     dp_size: int) -> list[float]:
    """Each sequence's per-token weight under the algorithm's aggregation over the global batch."""
    const = algorithm.cfg.loss_constant or totals.max_response_len
    weights = token_weights(algorithm.loss_agg, [s.num_loss_tokens for s in seqs], totals.loss_tokens,
                            totals.num_seqs, const)
    # Gradients are averaged over data-parallel replicas; scale each replica's sum back up.
    return [w * dp_size for w in weights]


def micro_batch_loss(algorithm: Algorithm, mb: MicroBatch, out: ForwardOutputs, sums: dict[str, float],
                     dp_size: int, real: bool) -> torch.Tensor:
    """The scalar to backpropagate for one micro-batch (policy and, with a critic, value loss).

    Metric sums go into `sums`; the KL, entropy and value sums are kept on placeholder micro-batches
    too (zero there), so every rank all-reduces the same keys."""
    acfg = algorithm.cfg
    logp = out.logprobs
    x = LossInputs(logp, mb.old_logprobs, mb.advantages, mb.mask, mb.seq_ids, entropy=out.entropy,
                   ref_logprobs=out.ref_logprobs, teacher_logprobs=out.teacher_logprobs,
                   prox_logprobs=mb.prox_logprobs)
    if x.ref_logprobs is not None and acfg.kl_mode == "reward":
        x.advantages = kl_reward_penalty(x.advantages, logp.detach(), x.ref_logprobs, mb.mask, mb.seq_ids,
                                         acfg.kl_coef)
    extra_loss = 0.0
    if out.values is not None:
        extra_loss = _critic_and_gae(algorithm, mb, x, out.values, sums)
    tis = None
    if algorithm.corrects_off_policy:
        x, *tis = corrected_inputs(x, acfg.tis_mode, acfg.tis_clip_low, acfg.tis_clip_high)
    tok_loss, metrics = algorithm.token_loss(x)
    if tis is not None:
        tok_loss = tok_loss * tis[0]
    if x.ref_logprobs is not None:
        kl = kl_estimate(logp, x.ref_logprobs, acfg.kl_estimator)
        if acfg.kl_mode == "loss":
            tok_loss = tok_loss + acfg.kl_coef * kl
        _acc(sums, "kl", (kl.detach() * mb.mask).sum())
    if out.entropy is not None:
        tok_loss = tok_loss - acfg.entropy_coef * out.entropy
        _acc(sums, "entropy", (out.entropy.detach() * mb.mask).sum())
    loss = (tok_loss * mb.weights).sum() + extra_loss
    for key, per_token in metrics.items():
        # An algorithm's own metrics ("name/...") are token means; summed on placeholders too (zero
        # there), so every rank all-reduces the same keys.
        if "/" in key:
            _acc(sums, key, (per_token.detach() * mb.mask).sum())
    if real:
        with torch.no_grad():
            # The reported loss is the aggregated one: undo the data-parallel scale-up of the weights.
            _acc(sums, "loss", (tok_loss * mb.weights).sum() / dp_size)
            _acc(sums, "tokens", mb.mask.sum())
            _acc(sums, "nll", (-logp * mb.mask).sum())
            if "clipfrac" in metrics:
                _acc(sums, "clipped", (metrics["clipfrac"] * mb.mask).sum())
            if algorithm.on_rollouts:
                # (B, T-1): log π_train − log π_rollout on the sampled tokens; 0 off the mask, where
                # old_logprobs are fillers and exp() could overflow into a NaN times zero.
                delta = torch.where(mb.mask > 0, logp - mb.old_logprobs, torch.zeros_like(logp))
                _acc(sums, "logp_diff", (delta.abs() * mb.mask).sum())
                # k3 = r − 1 − log r with r = π_train / π_rollout: an unbiased, never negative estimate of
                # KL(π_rollout ‖ π_train) from tokens the engine sampled.
                _acc(sums, "mismatch_kl", ((torch.expm1(delta) - delta) * mb.mask).sum())
                _acc(sums, "mismatch_tokens", ((delta.abs() > MISMATCH_THRESHOLD) * mb.mask).sum())
            if tis is not None:
                for k, v in tis_sums(tis[0], tis[1], x.old_logprobs, mb.old_logprobs, mb.mask).items():
                    _acc(sums, k, v)
    return loss


def step_metrics(algorithm: Algorithm, red: dict[str, float]) -> dict[str, float]:
    """The step's loss metrics from the all-reduced sums, under the algorithm's metric prefix."""
    n = max(red.get("tokens", 0.0), 1.0)
    prefix = algorithm.metric_prefix
    out = {f"{prefix}/loss": red.get("loss", 0.0), f"{prefix}/loss_tokens": red.get("tokens", 0.0),
           f"{prefix}/nll": red.get("nll", 0.0) / n}
    if algorithm.on_rollouts:
        out[f"{prefix}/clipfrac"] = red.get("clipped", 0.0) / n
        out[f"{prefix}/rollout_logprob_abs_diff"] = red.get("logp_diff", 0.0) / n
        out[f"{prefix}/rollout_mismatch_kl"] = red.get("mismatch_kl", 0.0) / n
        out[f"{prefix}/rollout_mismatch_frac"] = red.get("mismatch_tokens", 0.0) / n
        for k in ("kl", "entropy", "value_loss", "value_mean"):
            if k in red:
                out[f"{prefix}/{k}"] = red[k] / n
        out.update(tis_metrics(red, n))
    out.update({k: v / n for k, v in red.items() if "/" in k})
    return out


def _critic_and_gae(algorithm: Algorithm, mb: MicroBatch, x: LossInputs, values: torch.Tensor,
                    sums: dict[str, float]) -> torch.Tensor:
    """PPO: GAE advantages over the critic's values into `x`, and the critic's weighted loss."""
    acfg = algorithm.cfg
    # The sequence's reward sits on its last loss token; every other token's reward is 0 (or -KL).
    rewards = torch.zeros_like(values)
    for b in range(mb.mask.shape[0]):
        pos = mb.mask[b].nonzero().flatten()
        if len(pos):
            rewards[b, pos[-1]] = mb.advantages[b, pos[-1]]
    old_values = values.detach()
    adv, returns = gae(rewards, old_values, mb.mask, acfg.gamma, acfg.gae_lambda)
    if x.ref_logprobs is not None and acfg.kl_mode == "reward":
        # The KL penalty was folded into `x.advantages`; keep that part on top of GAE.
        adv = adv + (x.advantages - mb.advantages) * mb.mask
    x.advantages = adv
    v_loss = value_loss(values, old_values, returns, acfg.value_clip)
    _acc(sums, "value_loss", (v_loss.detach() * mb.mask).sum())
    _acc(sums, "value_mean", (old_values * mb.mask).sum())
    return (v_loss * mb.weights).sum()


def _acc(sums: dict[str, float], key: str, value) -> None:
    sums[key] = sums.get(key, 0.0) + float(value)
