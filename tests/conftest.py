"""Shared fixtures: one tiny real model per test session, one local Ray cluster per session."""

from __future__ import annotations

import os
import signal
import socket

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run only where torch sees a CUDA device (scripts/gpu-check.sh runs them)."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from miles.models.presets import build_tiny_model

    return str(build_tiny_model("tiny-qwen3", tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture(scope="session")
def tiny_vl_model_dir(tmp_path_factory) -> str:
    """The tiny-qwen-vl preset (Qwen2.5-VL), with weights large enough that images change the outputs."""
    from miles.models.presets import build_tiny_model

    return str(build_tiny_model("tiny-qwen-vl", tmp_path_factory.mktemp("tiny-qwen-vl"), init_std=0.05))


@pytest.fixture(scope="session")
def tiny_qwen3_vl_model_dir(tmp_path_factory) -> str:
    """The tiny-qwen3-vl preset (Qwen3-VL: deepstack, interleaved M-RoPE), weights as tiny_vl_model_dir's."""
    from miles.models.presets import build_tiny_model

    return str(build_tiny_model("tiny-qwen3-vl", tmp_path_factory.mktemp("tiny-qwen3-vl"), init_std=0.05))


@pytest.fixture(scope="session")
def ray_cluster():
    """A local cluster of this session's own (as `miles train` starts one), whatever else runs on the machine."""
    import ray

    from miles.orchestration.ray_cluster import ensure_ray
    from miles.run_sections import RayConfig

    ensure_ray(RayConfig(num_cpus=2))
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory) -> str:
    """The tiny-qwen3-moe preset (8 experts, top-2) with weights large enough that routing matters."""
    from miles.models.presets import build_tiny_model

    return str(build_tiny_model("tiny-qwen3-moe", tmp_path_factory.mktemp("tiny-qwen3-moe"), init_std=0.1))


# -- engines to push weights into (weight-sync tests, and the engine's own weight-route tests) ------------
@pytest.fixture(scope="session")
def preset_dir(tmp_path_factory):
    """preset_dir(name): that tiny preset built once per session, with weights large enough (std 0.1)
    that greedy outputs and routing vary."""
    from miles.models.presets import build_tiny_model

    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(build_tiny_model(name, tmp_path_factory.mktemp(name), init_std=0.1))
        return built[name]
    return get


@pytest.fixture(scope="session")
def admin_token() -> str:
    return "sync-admin-token"


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory) -> str:
    from miles.models.presets import build_tiny_model

    return str(build_tiny_model("tiny-qwen3", tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture(scope="module")
def engine_proc(base_model_dir, admin_token):
    """An engine in its own process, as in a real deployment."""
    from miles.engine.process import EngineProcess

    with EngineProcess(base_model_dir, admin_token=admin_token) as proc:
        yield proc


@pytest.fixture(scope="module")
def engine_thread(base_model_dir, admin_token):
    """An engine served from a thread of the test process (start_server_thread)."""
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=admin_token))
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _engines_restart_their_numbering(request, admin_token):
    """Engines shared by a module's tests hold the version an earlier test committed, and versions only
    move forward: each test that uses them starts the numbering afresh, as a new run on long-lived
    engines does, with SGLang's explicit relabel."""
    import httpx

    for name in ("engine_proc", "engine_thread"):
        if name in request.fixturenames:
            url = request.getfixturevalue(name).url
            httpx.post(f"{url}/update_weight_version", json={"new_version": "default"}, timeout=60,
                       headers={"Authorization": f"Bearer {admin_token}"}).raise_for_status()


@pytest.fixture(autouse=True)
def _no_router_outlives_its_test(request):
    """A run's router outlives a killed driver by design (orchestration/router_supervisor.py); a test
    whose driver was killed, or timed out, must not leave it running. After each test with a tmp_path,
    every router recorded under it (router.json) that still runs on this machine is ended."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    tmp_path = request.getfixturevalue("tmp_path")
    yield
    from miles.orchestration.router_supervisor import RECORD, RouterRecord

    for path in tmp_path.rglob(RECORD):
        record = RouterRecord.load(path)
        if record is None or record.host != socket.gethostname():
            continue
        try:
            cmdline = open(f"/proc/{record.pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"miles.rollout.router" in cmdline:  # that router, not a process that took its pid later
            os.kill(record.pid, signal.SIGKILL)
