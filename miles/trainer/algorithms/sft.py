"""Supervised fine-tuning as an algorithm: the token loss is the negative log-likelihood of the
demonstration tokens (token mean), on data rather than sampled rollouts (temperature 1, no
rollout logprobs to compare with). Its metrics are reported under `sft/`."""

from __future__ import annotations

from miles.trainer.algorithms.base import AlgorithmBase, LossInputs


class SFT(AlgorithmBase):
    on_rollouts = False
    metric_prefix = "sft"

    def advantages(self, rewards: list[float]) -> list[float]:
        return [0.0] * len(rewards)

    def token_loss(self, x: LossInputs):
        return -x.logprobs, {}
