"""Reward functions and their registry.

A reward function takes the response text and the prompt's reference label and returns a float.
It is chosen by name from REWARDS or given as `module:function`, checked (callable, two required
arguments) when the run is configured.
"""

from __future__ import annotations

from typing import Callable, Protocol

from miles.registry import Registry


class RewardFn(Protocol):
    def __call__(self, response: str, label: str | None) -> float: ...


def exact_match(response: str, label: str | None) -> float:
    """1.0 when the stripped response equals the label exactly, else 0.0."""
    return float(label is not None and response.strip() == label.strip())


def text_parity(response: str, label: str | None) -> float:
    """1.0 when the response has an odd number of characters: a synthetic reward that even an
    untrained model earns about half the time, so every group carries signal (throughput benchmarks)."""
    return float(len(response) % 2)


REWARDS: Registry[Callable[[str, str | None], float]] = Registry(
    "reward", arity=2, hint=" (a function (response, label) -> float)")
REWARDS.register("exact_match", exact_match)
REWARDS.register("text_parity", text_parity)


def get_reward_fn(spec: str) -> RewardFn:
    """The reward function `spec` names (registry name or `module:function`); RegistryError names the fix."""
    return REWARDS.get(spec)
