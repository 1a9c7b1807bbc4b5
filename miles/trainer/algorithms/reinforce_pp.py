"""REINFORCE++: no critic and no per-group baseline; rewards are whitened across the whole global
batch (mean 0, std 1). REINFORCE++-baseline first subtracts the group mean, then divides by the
global batch's std. The per-token loss is the clipped surrogate; a KL-to-reference penalty, if set,
is usually folded into the reward (kl_mode = "reward")."""

from __future__ import annotations

import statistics

from miles.trainer.algorithms.base import AlgorithmBase


class ReinforcePP(AlgorithmBase):
    def advantages(self, rewards: list[float]) -> list[float]:
        return list(rewards)

    def batch_advantages(self, advantages: list[float]) -> list[float]:
        if len(advantages) < 2:
            return [0.0] * len(advantages)
        mean, std = statistics.fmean(advantages), statistics.pstdev(advantages)
        return [(a - mean) / (std + 1e-6) for a in advantages]


class ReinforcePPBaseline(AlgorithmBase):
    group_relative = True

    def advantages(self, rewards: list[float]) -> list[float]:
        mean = statistics.fmean(rewards)
        return [r - mean for r in rewards]

    def batch_advantages(self, advantages: list[float]) -> list[float]:
        if len(advantages) < 2:
            return list(advantages)
        std = statistics.pstdev(advantages)
        return [a / (std + 1e-6) for a in advantages]
