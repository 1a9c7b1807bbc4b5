"""Environments for multi-turn rollouts: the contract, the registry, the built-ins and the sandbox.

    contract.py   Environment (reset / step / close) and StepResult
    tool_calc.py  a calculator tool for arithmetic problems
    terminal.py   shell tasks checked by a verifier, each episode in its own sandbox, with the tasks
    sandbox.py    namespaces, a throwaway uid and limits for the commands of terminal episodes

Where tasks live: a task whose episodes need an environment (its files, its verifier) is part of
that environment and lives in its module here, e.g. terminal.py's TASKS and their prompt source.
Task data that a single-turn rollout scores without an environment (arithmetic) stays a prompt
source under rollout/tasks/. Every prompt source, either kind, is chosen from the one registry in
rollout/tasks.

Environments are chosen by name from ENVIRONMENTS or given as `module:function`, where the function
takes no arguments and returns a fresh environment (a class with a no-argument constructor works
too); it is checked against the contract when the run is configured. Built-ins are registered as
`module:attr` strings, so naming one imports only that one. Non-goals: batched/vectorised
environments, environment-side tokenization.
"""

from __future__ import annotations

from typing import Callable

from miles.registry import Registry, RegistryError, protocol_methods
from miles.rollout.environments.contract import Environment, StepResult

__all__ = ["ENVIRONMENTS", "Environment", "StepResult", "check_environment", "get_environment"]

ENVIRONMENTS: Registry[Callable[[], Environment]] = Registry(
    "environment", protocol=Environment, arity=0,
    hint=" (a function with no arguments returning an Environment: reset(task) -> str, "
         "step(action) -> StepResult, close())")
ENVIRONMENTS.register("tool_calc", "miles.rollout.environments.tool_calc:CalculatorEnv")
ENVIRONMENTS.register("terminal", "miles.rollout.environments.terminal:TerminalEnv")


def get_environment(spec: str) -> Callable[[], Environment]:
    """The factory for `spec` (a registry name or `module:function`); RegistryError names the fix."""
    return ENVIRONMENTS.get(spec)


def check_environment(spec: str) -> None:
    """Load `spec`, build one instance and check it has reset/step/close; RegistryError otherwise."""
    factory = get_environment(spec)
    try:
        env = factory()
    except TypeError as e:
        raise RegistryError(f"environment {spec!r} must be callable with no arguments: {e}") from None
    if not isinstance(env, Environment):
        missing = [m for m in protocol_methods(Environment) if not callable(getattr(env, m, None))]
        raise RegistryError(f"environment {spec!r} returned {type(env).__name__}, which lacks {missing}: "
                            "implement reset(task) -> str, step(action) -> StepResult and close()")
    env.close()
