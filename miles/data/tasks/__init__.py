"""Prompt sources: seeded task generators with verifiable answers, chosen by `rollout.task.name`.

A source is built by a factory `(task_config, split, seed) -> TaskSource` (contract.py) from the
TASKS registry, or given as `module:function`. Layout: task data that a single-turn rollout scores
on its own (arithmetic.py) lives here; a task whose episodes need an environment lives with that
environment in rollout/environments/ (terminal.py holds the terminal tasks and registers their
source here), so an environment and the tasks it reads never drift apart. Entries are
`module:attr` strings: naming one source imports only that one. Rows from files are the `dataset`
source (data/source.py). Non-goal: reading files here.
"""

from __future__ import annotations

from typing import Callable

from miles.registry import Registry
from miles.data.tasks.contract import Problem, TaskSource

__all__ = ["TASKS", "Problem", "TaskSource"]

TASKS: Registry[Callable[..., TaskSource]] = Registry(
    "task", arity=3, hint=" (a function (task_config, split, seed) returning an object with take(n) -> [Problem])")
TASKS.register("arithmetic", "miles.data.tasks.arithmetic:task_source")
TASKS.register("terminal", "miles.rollout.environments.terminal:task_source")
TASKS.register("dataset", "miles.data.source:task_source")
