"""A generation that is running when new weights are committed finishes on them and reports both
weight versions; a request that starts afterwards reports only the new one."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
import torch

pytestmark = pytest.mark.e2e

TOKEN = "versions-token"


def _generate(url: str, n: int) -> dict:
    r = httpx.post(f"{url}/generate", timeout=120, json={
        "input_ids": [19, 20, 15, 21], "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def test_generation_across_an_update_reports_both_versions(tiny_model_dir):
    from miles.models.loading import load_model
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread
    from miles.sync.prepare import SyncConfig
    from miles.sync.updater import WeightUpdater
    from miles.sync.verify import unique_tensors

    server = start_server_thread(EngineConfig(model_path=tiny_model_dir, admin_token=TOKEN))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    updater = WeightUpdater(SyncConfig(transport="p2p", bucket_size_mb=1), TOKEN, tiny_model_dir)
    updater.connect([server.url])
    pool = cf.ThreadPoolExecutor(1)
    try:
        names = set(unique_tensors(load_model(tiny_model_dir)))  # tied lm_head travels as the embedding
        base = {n: t for n, t in load_model(tiny_model_dir).state_dict().items() if n in names}
        updater.push(iter(base.items()), version=1)  # the verified first update
        # Hold the running request between two decode steps while the update lands (in-place pause),
        # so the update falls mid-generation whatever the machine's speed.
        running = pool.submit(_generate, server.url, 300)
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/get_load").json()["num_running_reqs"] == 0:
            assert time.monotonic() < deadline and not running.done(), "the request never started running"
            time.sleep(0.01)
        r = httpx.post(f"{server.url}/pause_generation", json={"mode": "in_place"}, headers=headers)
        assert r.status_code == 200, r.text
        g = torch.Generator().manual_seed(0)
        state = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in base.items()}
        updater.push(iter(state.items()), version=2)
        assert httpx.post(f"{server.url}/continue_generation", headers=headers).status_code == 200
        meta = running.result(timeout=120)
        # SGLang's spans: which tokens each version wrote, versions as strings.
        spans = meta["weight_versions"]
        assert [s["version"] for s in spans] == ["1", "2"] and meta["weight_version"] == "2"
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 300
        assert meta["completion_tokens"] == 300
        assert _generate(server.url, 4)["weight_versions"] == [{"version": "2", "start": 0, "end": 4}]
    finally:
        pool.shutdown(wait=False)
        updater.close()
        server.stop()
