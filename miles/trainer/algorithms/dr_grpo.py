"""Dr.GRPO ("GRPO done right"): no division by the group's std and no division by each response's
length. Each sequence's token-loss sum is divided by one constant (the generation budget), so long
and short responses are weighted alike per token and easy/hard prompts alike per group."""

from __future__ import annotations

import statistics

from miles.trainer.algorithms.base import AlgorithmBase


class DrGRPO(AlgorithmBase):
    group_relative = True

    default_loss_agg = "seq_mean_token_sum_norm"

    def advantages(self, rewards: list[float]) -> list[float]:
        mean = statistics.fmean(rewards)
        return [r - mean for r in rewards]
