"""Prompt sources: chosen by name through the tasks registry, seeded, with disjoint splits."""

from __future__ import annotations

import pytest

from miles.config import ConfigError
from miles.registry import RegistryError
from miles.data.prompts import PromptSource, TaskConfig
from miles.rollout.environments.terminal import TASKS as TERMINAL_TASKS
from miles.data.tasks import TASKS


def test_every_source_is_reached_by_its_name_from_the_task_config():
    assert TASKS.names() == ["arithmetic", "dataset", "terminal"]  # dataset: tests/unit/data
    arithmetic = PromptSource(TaskConfig(name="arithmetic", digits=3), "train", seed=5).take(4)
    assert [p.index for p in arithmetic] == [0, 1, 2, 3] and all(p.text.endswith("=") for p in arithmetic)
    terminal = PromptSource(TaskConfig(name="terminal"), "train", seed=5).take(len(TERMINAL_TASKS))
    assert {p.label for p in terminal} == {t.name for t in TERMINAL_TASKS}


def test_sources_are_seeded_and_arithmetic_splits_are_disjoint():
    cfg = TaskConfig(name="arithmetic", digits=2)
    again = PromptSource(cfg, "train", seed=1).take(20)
    assert again == PromptSource(cfg, "train", seed=1).take(20)
    train = {p.text for p in PromptSource(cfg, "train", seed=1).take(300)}
    held_out = {p.text for p in PromptSource(cfg, "eval", seed=1).take(100)}
    assert not train & held_out


def test_unknown_sources_are_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"rollout.task.name: unknown task 'nope': choose one of \['arithmetic', 'dataset', 'terminal'\]"):
        TaskConfig(name="nope").validate()
    with pytest.raises(RegistryError, match="must take 3 required positional arguments"):
        TASKS.get("miles.data.tasks.arithmetic:demonstration")
