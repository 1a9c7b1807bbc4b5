"""The `(response, label) -> float` view of a reward, for callers that score one text at a time
(evaluation, older generate functions). The reward contract, built-ins and runner live in
miles/rewards/; this module only adapts them.

Non-goal: scoring training samples (miles.rewards.runner.RewardRunner does, in one place).
"""

from __future__ import annotations

from typing import Protocol

from miles.rewards.builtins import exact_match, text_parity
from miles.rewards.config import RewardConfig
from miles.rewards.contract import REWARDS
from miles.rewards.runner import RewardRunner


class RewardFn(Protocol):
    def __call__(self, response: str, label: str | None) -> float: ...


def get_reward_fn(spec: str, cfg: RewardConfig | None = None) -> RewardFn:
    """A `(response, label) -> float` for the reward `spec` names (registry name, module:function or
    file.py:function, of any contract in docs/rewards.md); RegistryError names the fix."""
    return RewardRunner(spec, cfg).score_text


__all__ = ["REWARDS", "RewardFn", "exact_match", "get_reward_fn", "text_parity"]
