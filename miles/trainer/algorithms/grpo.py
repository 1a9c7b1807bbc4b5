"""GRPO: advantages are rewards normalised within the group; the clipped surrogate per token."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from miles.trainer.algorithms.base import AlgorithmBase, AlgorithmConfig


class GRPO(AlgorithmBase):
    group_relative = True

    @dataclass
    class Config(AlgorithmConfig):
        std_normalize: bool = True
        """Divide group-centred rewards by the group's standard deviation."""

    cfg: Config

    def advantages(self, rewards: list[float]) -> list[float]:
        mean = statistics.fmean(rewards)
        centred = [r - mean for r in rewards]
        if not self.cfg.std_normalize or len(rewards) < 2:
            return centred
        std = statistics.pstdev(rewards)
        return [c / (std + 1e-6) for c in centred]
