"""Fixtures for agent tests: a tiny model with varied random weights served by a real engine process."""

from __future__ import annotations

import pytest

from tests.helpers.models import build_varied_tiny_model


@pytest.fixture(scope="session")
def agent_model_dir(tmp_path_factory) -> str:
    return build_varied_tiny_model(tmp_path_factory.mktemp("agent-model"), seed=3)


@pytest.fixture(scope="session")
def agent_tokenizer(agent_model_dir):
    from miles.models.loading import load_tokenizer

    return load_tokenizer(agent_model_dir)


@pytest.fixture(scope="session")
def agent_engine_url(agent_model_dir):
    from miles.engine.process import EngineProcess

    with EngineProcess(agent_model_dir) as proc:
        yield proc.url
