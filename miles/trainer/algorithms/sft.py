"""Supervised fine-tuning loss: negative log-likelihood of the demonstration tokens, token mean."""

from __future__ import annotations

from miles.trainer.algorithms.base import AlgorithmBase, LossInputs


class SFT(AlgorithmBase):
    def advantages(self, rewards: list[float]) -> list[float]:
        return [0.0] * len(rewards)

    def token_loss(self, x: LossInputs):
        return -x.logprobs, {}
