"""Reward functions and their registry.

A reward function takes the response text and the prompt's reference label and returns a float.
User functions can be given as `module:function` and are checked when the run is configured.
"""

from __future__ import annotations

import inspect
from typing import Callable, Protocol


class RewardFn(Protocol):
    def __call__(self, response: str, label: str | None) -> float: ...


def exact_match(response: str, label: str | None) -> float:
    """1.0 when the stripped response equals the label exactly, else 0.0."""
    return float(label is not None and response.strip() == label.strip())


def text_parity(response: str, label: str | None) -> float:
    """1.0 when the response has an odd number of characters: a synthetic reward that even an
    untrained model earns about half the time, so every group carries signal (throughput benchmarks)."""
    return float(len(response) % 2)


REWARDS: dict[str, Callable[[str, str | None], float]] = {"exact_match": exact_match, "text_parity": text_parity}


def get_reward_fn(name: str) -> Callable[[str, str | None], float]:
    from miles.registry import resolve

    if name in REWARDS:
        return REWARDS[name]
    fn = resolve(name, REWARDS, "reward")
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) != 2:
        raise ValueError(f"reward {name!r} must take (response, label); it takes {len(params)} required arguments")
    return fn
