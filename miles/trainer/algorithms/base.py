"""The per-token policy-loss core every algorithm builds on.

An algorithm supplies two things: per-sample advantages from a group's rewards, and per-token
losses from current/old logprobs. Aggregation is shared: token-level sums divided by the number of
loss tokens in the whole global batch, so the result does not depend on how samples are split into
micro-batches or ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    """Algorithm by name: grpo."""
    clip_eps_low: float = 0.2
    """Lower clip range of the importance ratio (ratio >= 1 - clip_eps_low)."""
    clip_eps_high: float = 0.2
    """Upper clip range of the importance ratio (ratio <= 1 + clip_eps_high)."""
    std_normalize: bool = True
    """Divide group-centred rewards by the group's standard deviation."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ConfigError("algorithm.clip_eps_low/high must be >= 0")


class Algorithm(Protocol):
    def advantages(self, rewards: list[float]) -> list[float]: ...

    def token_loss(self, logprobs: "torch.Tensor", old_logprobs: "torch.Tensor",
                   advantages: "torch.Tensor") -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]: ...


def clipped_surrogate(logprobs, old_logprobs, advantages, clip_low: float, clip_high: float):
    """PPO's clipped objective per token, as a loss. All inputs (N,) over loss tokens.

    Returns the per-token loss and the per-token indicator of clipping (for clipfrac).
    """
    import torch

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float()
