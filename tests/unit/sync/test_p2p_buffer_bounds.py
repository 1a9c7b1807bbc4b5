"""Shared-memory buffers an engine lends a p2p sender are bounded: in size by the served model (a
larger ask gets the model's worth, and says so), by the free space of /dev/shm (refused before any
page is touched, where touching it would kill the engine with SIGBUS), and in number."""

from __future__ import annotations

import os

import httpx
import pytest

from miles.sync import shm
from miles.sync.transports import p2p


@pytest.fixture
def post(engine_thread, admin_token):
    def _post(path: str, body: dict):
        return httpx.post(f"{engine_thread.url}{path}", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {admin_token}"})
    return _post


def _model_bytes(engine) -> int:
    return sum(t.numel() * 4 for t in engine.model.state_dict().values())


def test_a_huge_ask_gets_at_most_the_models_size(post, engine_thread):
    r = post("/p2p_open_buffer", {"nbytes": 1 << 40})  # 1 TiB
    assert r.status_code == 200, r.text
    lent = r.json()["nbytes"]
    try:
        assert 0 < lent < 2 * _model_bytes(engine_thread.engine) + (2 << 20)
        assert os.path.getsize(r.json()["shm_path"]) == lent
    finally:
        post("/p2p_close_buffer", {"shm_path": r.json()["shm_path"]})


def test_an_ask_beyond_free_shared_memory_is_refused_before_any_page_is_touched(post, monkeypatch):
    monkeypatch.setattr(shm, "free_bytes", lambda: 1 << 16)  # a nearly full /dev/shm
    before = set(os.listdir(shm.SHM_DIR))
    r = post("/p2p_open_buffer", {"nbytes": 1 << 20})
    assert r.status_code == 400 and "free in" in r.json()["error"], r.text
    assert set(os.listdir(shm.SHM_DIR)) - before == set()


def test_the_number_of_lent_buffers_is_bounded(post):
    paths = []
    try:
        for _ in range(p2p.MAX_BUFFERS):
            r = post("/p2p_open_buffer", {"nbytes": 4096})
            assert r.status_code == 200, r.text
            paths.append(r.json()["shm_path"])
        r = post("/p2p_open_buffer", {"nbytes": 4096})
        assert r.status_code == 400 and "close one" in r.json()["error"], r.text
    finally:
        for p in paths:
            post("/p2p_close_buffer", {"shm_path": p})
    r = post("/p2p_open_buffer", {"nbytes": 4096})  # closing frees the slots
    assert r.status_code == 200
    post("/p2p_close_buffer", {"shm_path": r.json()["shm_path"]})
