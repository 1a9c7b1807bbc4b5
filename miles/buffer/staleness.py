"""Staleness: how many policy updates a group's oldest weights are behind the trainer.

It is a property of the moment, not of the group: a group sitting in the buffer grows staler with
every training step, so it is measured when the trainer collects the group (and once more on
arrival, because a long multi-turn group can already be stale when it lands).
"""

from __future__ import annotations

from miles.buffer.types import Group


def staleness(group: Group, policy_version: int) -> int:
    """Current policy version − the oldest weight version among every sample and turn of the group."""
    return policy_version - group.oldest_weight_version
