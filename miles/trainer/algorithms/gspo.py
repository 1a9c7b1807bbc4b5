"""GSPO: the importance ratio is per sequence, exp(mean over its tokens of log π/π_old), and clipped
as a whole, with a much tighter range than token-level PPO (3e-4 / 4e-4). The clipped sequence loss
is spread over the sequence's tokens and aggregated as a mean over sequences."""

from __future__ import annotations

from miles.trainer.algorithms.base import LossInputs, clipped_surrogate
from miles.trainer.algorithms.grpo import GRPO


class GSPO(GRPO):
    default_clip = (3e-4, 4e-4)
    default_loss_agg = "seq_mean_token_mean"

    def token_loss(self, x: LossInputs):
        import torch

        # Mean log-ratio per sequence over its loss tokens, gathered back onto each token. (B, T-1)
        delta = (x.logprobs - x.old_logprobs) * x.mask
        ids = torch.where(x.seq_ids >= 0, x.seq_ids, 0).flatten()
        n_seq = int(x.seq_ids.max().item()) + 1 if x.seq_ids.numel() else 0
        sums = torch.zeros(max(n_seq, 1), dtype=delta.dtype, device=delta.device).index_add(0, ids, delta.flatten())
        counts = torch.zeros(max(n_seq, 1), dtype=delta.dtype, device=delta.device).index_add(0, ids, x.mask.flatten())
        seq_log_ratio = (sums / counts.clamp(min=1.0))[ids].view_as(delta)
        # Per-token gradient of the sequence ratio equals that of the mean log-ratio.
        loss, clipped = clipped_surrogate(seq_log_ratio, torch.zeros_like(seq_log_ratio), x.advantages,
                                          self.clip_low, self.clip_high, self.cfg.dual_clip_c)
        return loss, {"clipfrac": clipped}
