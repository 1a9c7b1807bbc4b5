"""Fixtures for weight-sync tests: a tiny model and engines to push weights into."""

from __future__ import annotations

import pytest

ADMIN_TOKEN = "sync-admin-token"


@pytest.fixture(scope="session")
def admin_token() -> str:
    return ADMIN_TOKEN


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory) -> str:
    from miles.models.presets import build_tiny_model

    return str(build_tiny_model("tiny-qwen3", tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture(scope="module")
def engine_proc(base_model_dir):
    """An engine in its own process, as in a real deployment."""
    from miles.rollout.engine.process import EngineProcess

    with EngineProcess(base_model_dir, admin_token=ADMIN_TOKEN) as proc:
        yield proc


@pytest.fixture(scope="module")
def engine_thread(base_model_dir):
    """A second engine served from a thread of the test process (start_server_thread)."""
    from miles.rollout.engine.config import EngineConfig
    from miles.rollout.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=ADMIN_TOKEN))
    yield server
    server.stop()
