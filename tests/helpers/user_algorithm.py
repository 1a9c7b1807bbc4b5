"""A user's algorithm given as `module:function` in a run config (the extension point under test)."""

from __future__ import annotations

from miles.trainer.algorithms import AlgorithmBase, AlgorithmConfig


class ScaledReinforce(AlgorithmBase):
    """Plain REINFORCE on group-centred rewards, scaled by 3 so its loss is told apart from the built-ins."""

    def advantages(self, rewards: list[float]) -> list[float]:
        mean = sum(rewards) / len(rewards)
        return [r - mean for r in rewards]

    def token_loss(self, x):
        return -3.0 * x.logprobs * x.advantages, {}


def make(cfg: AlgorithmConfig) -> ScaledReinforce:
    return ScaledReinforce(cfg)
