"""RLOO: each sample's baseline is the mean reward of the *other* samples of its group
(leave-one-out), an unbiased baseline without a critic."""

from __future__ import annotations

from miles.trainer.algorithms.base import AlgorithmBase


class RLOO(AlgorithmBase):
    group_relative = True

    def advantages(self, rewards: list[float]) -> list[float]:
        n = len(rewards)
        if n < 2:
            return [0.0] * n
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
