"""How the run's reward is run: workers, timeouts, what an error costs, and the settings of the
configured built-ins (regex, weighted).

Non-goals: which reward (rollout.reward names it), the reward contract (contract.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from miles.config import ConfigError


@dataclass
class RewardConfig:
    num_workers: int = 0
    """Processes that run a synchronous reward (CPU-heavy rewards); 0 runs it in a thread of the rollout
    process (a reward declared inline, such as `exact_match`, on its event loop)."""
    timeout_s: float = 30.0
    """Seconds one reward call may take; a call past it is counted in reward/timeouts and gets the fallback."""
    on_error: Literal["score", "drop_group"] = "score"
    """A sample whose reward raised or timed out: score (it gets fallback_score) or drop_group (its group
    goes to buffer.on_failure as reward_error)."""
    fallback_score: float = 0.0
    """The score a failed reward call gives its samples (on_error = score)."""
    max_error_rate: float = 0.5
    """Stop the run, with the reward's own traceback and the offending sample, once the share of failed
    calls (errors and timeouts) passes this, counted after min_calls calls; 1.0 never stops."""
    min_calls: int = 20
    """Calls to make before max_error_rate is checked."""
    regex_pattern: str = ""
    """The `regex` reward: a Python regular expression the response is searched for."""
    regex_full_match: bool = False
    """The `regex` reward: the whole stripped response must match (a format reward), not just contain a match."""
    weights: dict[str, float] = field(default_factory=dict)
    """The `weighted` reward: component reward (name, module:function or file.py:function) → weight; the
    score is the weighted sum and each component's mean is logged as reward/<component>."""

    def validate(self) -> None:
        if self.num_workers < 0 or self.min_calls < 0:
            raise ConfigError("rollout.reward_config.num_workers and .min_calls must be >= 0")
        if self.timeout_s <= 0:
            raise ConfigError("rollout.reward_config.timeout_s must be > 0")
        if not 0.0 <= self.max_error_rate <= 1.0:
            raise ConfigError("rollout.reward_config.max_error_rate must be in [0, 1] (1.0 never stops the run)")
        if "weighted" in self.weights:
            raise ConfigError("rollout.reward_config.weights: a component may not itself be 'weighted'")
