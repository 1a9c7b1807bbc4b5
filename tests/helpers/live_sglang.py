"""A live SGLang server for tests (sglang==0.5.23 on the CPU, from the venv scripts/install-sglang.sh
makes), launched as miles launches a run's engines, and put back to its launch state between the
checks that share it: its start-up costs 40-140 s on a 2-core machine, so a module shares one."""

from __future__ import annotations

import httpx
import pytest

from miles.engine.config import EngineConfig
from miles.sglang.config import SGLangConfig
from miles.sglang.server import SGLangServer


def launch(model_dir: str, token: str, routed_experts: bool = False) -> SGLangServer:
    """One server on `model_dir` with `token` as its admin key; fails the test, naming the fix, when
    there is no SGLang environment."""
    try:
        SGLangConfig().resolve_python()
    except Exception as exc:  # noqa: BLE001 - said in the failure
        pytest.fail(f"no SGLang environment: {exc}")
    return SGLangServer(EngineConfig(model_path=model_dir, device="cpu", memory_fraction=0.05, admin_token=token),
                        SGLangConfig(), routed_experts=routed_experts)


def relaunched(server: SGLangServer, model_dir: str, token: str) -> str:
    """The server as a new run finds a new one: generating, the checkpoint it was launched with loaded
    again, labelled with SGLang's initial version ("default"); an earlier check may have paused it,
    pushed other weights or relabelled them. Returns its URL."""
    admin = {"Authorization": f"Bearer {token}"}
    httpx.post(server.url + "/continue_generation", json={}, headers=admin, timeout=60)
    r = httpx.post(server.url + "/update_weights_from_disk", headers=admin, timeout=300,
                   json={"model_path": model_dir, "weight_version": "default"})
    assert r.status_code == 200 and r.json()["success"], r.text
    return server.url
