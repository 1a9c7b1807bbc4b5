"""PPO with a value model: per-token advantages by GAE over the critic's values, the clipped
surrogate for the policy and a clipped squared error for the critic.

The reward arrives as the sequence's only reward, on its last loss token. `advantages` therefore
passes raw rewards through; GAE runs in the trainer, where the critic's values exist.
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


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation along each row. All (B, T); rewards and values are read
    only where mask is 1 (one sequence per row; masked-out positions are skipped, not bootstrapped
    through). The value after a sequence's last loss token is 0 (episode end).

    Returns (advantages, returns), zero where mask is 0.
    """
    import torch

    B, T = rewards.shape
    adv = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype)
    running = torch.zeros(B, dtype=values.dtype)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = torch.where(m > 0, step, running)
        next_value = torch.where(m > 0, values[:, t], next_value)
        adv[:, t] = running * m
    return adv, (adv + values) * mask


def value_loss(values, old_values, returns, clip: float):
    """Per-token 0.5·(V - R)^2, the worse of clipped and unclipped when clip > 0 (PPO's value clip)."""
    import torch

    err = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * err
