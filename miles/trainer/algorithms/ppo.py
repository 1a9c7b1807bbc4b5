"""PPO with a value model: per-token advantages by GAE over the critic's values, the clipped
surrogate for the policy and a clipped squared error for the critic.

The reward arrives as the sequence's only reward, on its last loss token. `advantages` therefore
passes raw rewards through; GAE and the value loss run in the trainer, where the critic's values exist
(trainer/critic.py, composed by trainer/loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.loader import ConfigError
from miles.trainer.algorithms.base import AlgorithmBase, AlgorithmConfig


class PPO(AlgorithmBase):
    @dataclass
    class Config(AlgorithmConfig):
        gamma: float = 1.0
        """Discount factor of GAE."""
        gae_lambda: float = 0.95
        """GAE lambda."""
        value_clip: float = 0.2
        """Clip range of the value update around the rollout-time value (0 = off)."""
        critic_lr: float = 1e-4
        """AdamW learning rate of the value model."""

        def validate(self) -> None:
            super().validate()
            if not (0 < self.gamma <= 1 and 0 <= self.gae_lambda <= 1) or self.critic_lr <= 0:
                raise ConfigError("trainer.algorithm: need 0 < gamma <= 1, 0 <= gae_lambda <= 1 and critic_lr > 0")

    cfg: Config
    needs_critic = True

    def advantages(self, rewards: list[float]) -> list[float]:
        return list(rewards)
