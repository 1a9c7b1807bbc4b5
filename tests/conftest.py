"""Shared fixtures: one tiny real model per test session, one local Ray cluster per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from miles.models.presets import build_tiny_model

    return str(build_tiny_model("tiny-qwen3", tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory) -> str:
    """The tiny-qwen3-moe preset (8 experts, top-2) with weights large enough that routing matters."""
    from miles.models.presets import build_tiny_model

    return str(build_tiny_model("tiny-qwen3-moe", tmp_path_factory.mktemp("tiny-qwen3-moe"), init_std=0.1))
