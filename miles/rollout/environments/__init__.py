"""Environments for multi-turn rollouts: the contract, the registry, the built-ins and the sandbox.

    contract.py   Environment (reset / step / close), StepResult and Observation (text with images)
    tool_calc.py  a calculator tool for arithmetic problems
    terminal.py   shell tasks checked by a verifier, each episode in its own sandbox, with the tasks
    sandbox.py    namespaces, a throwaway uid and limits for the commands of terminal episodes (root backend)
    rootless.py   the same without privilege: user namespaces and bubblewrap (rootless backend)
    workdir.py    a sandbox's working directory; cgroup.py its memory and pids cgroup (both backends)

Where tasks live: a task whose episodes need an environment (its files, its verifier) is part of
that environment and lives in its module here, e.g. terminal.py's TASKS and their prompt source.
Task data that a single-turn rollout scores without an environment (arithmetic) stays a prompt
source under data/tasks/. Every prompt source, either kind, is chosen from the one registry in
data/tasks.

Environments are chosen by name from ENVIRONMENTS or given as `module:function`, where the function
needs no arguments and returns a fresh environment (a class with a no-argument constructor works
too); it is checked against the contract when the run is configured. The run config reaches it
through `rollout.agent.env_args` (keyword arguments for every episode's factory call) and
`rollout.agent.sandbox` (passed as `sandbox_config=` to a factory that takes that parameter). Built-ins are registered as
`module:attr` strings, so naming one imports only that one. Non-goals: batched/vectorised
environments, environment-side tokenization.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from miles.registry import Registry, RegistryError, protocol_methods
from miles.rollout.config import SandboxConfig
from miles.rollout.environments.contract import Environment, Observation, StepResult

__all__ = ["ENVIRONMENTS", "Environment", "Observation", "StepResult", "build_environment", "check_environment",
           "get_environment"]

ENVIRONMENTS: Registry[Callable[[], Environment]] = Registry(
    "environment", protocol=Environment, arity=0,
    hint=" (a function with no arguments returning an Environment: reset(task) -> str, "
         "step(action) -> StepResult, close())")
ENVIRONMENTS.register("tool_calc", "miles.rollout.environments.tool_calc:CalculatorEnv")
ENVIRONMENTS.register("terminal", "miles.rollout.environments.terminal:TerminalEnv")


def get_environment(spec: str) -> Callable[[], Environment]:
    """The factory for `spec` (a registry name or `module:function`); RegistryError names the fix."""
    return ENVIRONMENTS.get(spec)


def build_environment(spec: str, env_args: dict[str, Any] | None = None,
                      sandbox: SandboxConfig | None = None) -> Environment:
    """A fresh environment for one episode: the factory called with `env_args`, plus `sandbox_config`
    when the factory takes it."""
    factory = get_environment(spec)
    kwargs = dict(env_args or {})
    if sandbox is not None and "sandbox_config" not in kwargs and _takes(factory, "sandbox_config"):
        kwargs["sandbox_config"] = sandbox
    return factory(**kwargs)


def _takes(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def check_environment(spec: str, env_args: dict[str, Any] | None = None, sandbox: SandboxConfig | None = None) -> None:
    """Build one instance as a run would and check it has reset/step/close; RegistryError otherwise."""
    try:
        env = build_environment(spec, env_args, sandbox)
    except TypeError as e:
        raise RegistryError(f"environment {spec!r} cannot be built with rollout.agent.env_args "
                            f"{dict(env_args or {})}: {e}") from None
    if not isinstance(env, Environment):
        missing = [m for m in protocol_methods(Environment) if not callable(getattr(env, m, None))]
        raise RegistryError(f"environment {spec!r} returned {type(env).__name__}, which lacks {missing}: "
                            "implement reset(task) -> str, step(action) -> StepResult and close()")
    env.close()
