"""The value model's side of PPO: generalised advantage estimation over its values, and its loss.

The trainer runs the critic next to the policy when an algorithm declares `needs_critic`; trainer/loss.py
turns its per-token values into GAE advantages for the policy's loss and a clipped squared error for
the critic's own. Both work on padded rows, one sequence per row (packed rows are refused at config
time). Non-goal: building or stepping the critic (the backend's job).
"""

from __future__ import annotations

import torch


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation along each row. All (B, T); rewards and values are read
    only where mask is 1 (one sequence per row; masked-out positions are skipped, not bootstrapped
    through). The value after a sequence's last loss token is 0 (episode end).

    Returns (advantages, returns), zero where mask is 0.
    """
    B, T = rewards.shape
    adv = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    running = torch.zeros(B, dtype=values.dtype, device=values.device)
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
    err = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * err
