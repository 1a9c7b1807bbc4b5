"""The Environment protocol and its registry.

An environment is one episode's world: `reset(task)` starts it and returns the first observation
(the user message); each `step(action)` takes the model's text for one turn and returns what the
environment says back, the reward earned and whether the episode is over. The agent loop
(rollout/agent.py) owns tokens; environments only ever see and produce text.

Environments are chosen by name (`ENVIRONMENTS`) or given as `module:function`, where the function
takes no arguments and returns a fresh environment; it is checked against the Protocol when the run
is configured. Non-goals: batched/vectorised environments, environment-side tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable


@dataclass(frozen=True)
class StepResult:
    observation: str   # shown to the model as the next environment turn (ignored when done)
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    def reset(self, task) -> str:
        """Start an episode for `task` (a data-source Prompt: .text, .label, .index); return the first
        observation."""

    def step(self, action: str) -> StepResult:
        """Apply the model's turn (its text, special tokens stripped)."""

    def close(self) -> None:
        """Release what the episode holds (sandboxes, files); called once, also after a timeout."""


def _tool_calc():
    from miles.rollout.environments.tool_calc import CalculatorEnv

    return CalculatorEnv()


def _terminal():
    from miles.rollout.environments.terminal import TerminalEnv

    return TerminalEnv()


ENVIRONMENTS: dict[str, Callable[[], Environment]] = {"tool_calc": _tool_calc, "terminal": _terminal}


def get_environment(name: str) -> Callable[[], Environment]:
    """The factory for `name`; raises ValueError naming the fix when it is unknown or malformed."""
    from miles.registry import resolve

    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    factory = resolve(name, ENVIRONMENTS, "environment",
                      " (a function with no arguments returning an Environment)")
    if not callable(factory):
        raise ValueError(f"environment {name!r} is not callable: give a function returning an Environment")
    return factory


def check_environment(name: str) -> None:
    """Load `name`, build one instance and check it has reset/step/close; ValueError otherwise."""
    factory = get_environment(name)
    try:
        env = factory()
    except TypeError as e:
        raise ValueError(f"environment {name!r} must be callable with no arguments: {e}") from None
    if not isinstance(env, Environment):
        missing = [m for m in ("reset", "step", "close") if not callable(getattr(env, m, None))]
        raise ValueError(f"environment {name!r} returned {type(env).__name__}, which lacks {missing}: "
                         "implement reset(task) -> str, step(action) -> StepResult and close()")
    env.close()
