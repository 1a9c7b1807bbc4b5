"""DAPO: GRPO advantages with an asymmetric "clip-higher" range (1 - 0.2, 1 + 0.28) so unlikely
tokens can still gain probability, and a token-level loss (every token of the batch weighs the
same). Dynamic sampling (dropping groups with equal rewards) happens where groups are formed."""

from __future__ import annotations

from miles.trainer.algorithms.grpo import GRPO


class DAPO(GRPO):
    default_clip = (0.2, 0.28)
    default_loss_agg = "token_mean"
