"""A weight-update rendezvous or receive that never completes costs the request its deadline and
nothing else: it answers 400 within the engine's weight_update_timeout_s, holds no lock the HTTP
server needs, and /health and /destroy_weights_update_group answer at once meanwhile."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from miles.sync.transports.broadcast import BroadcastTransport

DEADLINE_S = 4.0


@pytest.fixture(scope="module")
def quick_engine(base_model_dir, admin_token):
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=admin_token,
                                              weight_update_timeout_s=DEADLINE_S))
    yield server
    server.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_background(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    return t, out


def _assert_responsive(url: str, admin_token: str) -> None:
    """The HTTP server answers control and health routes quickly while the slow request runs."""
    headers = {"Authorization": f"Bearer {admin_token}"}
    for method, path, body in (("GET", "/health", None), ("GET", "/get_weight_version", None),
                               ("POST", "/destroy_weights_update_group", {"group_name": "nobody"})):
        t0 = time.monotonic()
        r = httpx.request(method, url + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 200 and time.monotonic() - t0 < 1.5, (path, r.text)


def test_joining_a_closed_port_fails_at_the_deadline_and_blocks_nothing(quick_engine, admin_token):
    url = quick_engine.url
    t0 = time.monotonic()
    t, out = _in_background(lambda: httpx.post(url + "/init_weights_update_group", timeout=60, json={
        "master_address": "127.0.0.1", "master_port": _closed_port(), "rank_offset": 1, "world_size": 2,
        "group_name": "g", "backend": "gloo"}, headers={"Authorization": f"Bearer {admin_token}"}))
    time.sleep(0.5)
    _assert_responsive(url, admin_token)
    t.join(DEADLINE_S * 2 + 10)
    r = out["r"]
    assert r.status_code == 400 and "deadline" in r.json()["error"], r.text
    assert time.monotonic() - t0 < DEADLINE_S * 2 + 5


def test_a_sender_that_never_sends_the_bytes_fails_the_receive_at_the_deadline(quick_engine, admin_token):
    url = quick_engine.url
    before = quick_engine.engine.weight_version
    sender = BroadcastTransport(admin_token=admin_token, timeout_s=30)
    sender.connect([url])
    try:
        name = "model.norm.weight"
        shape = list(quick_engine.engine.model.state_dict()[name].shape)
        t0 = time.monotonic()
        # The metadata arrives; the broadcast never follows (a stalled trainer).
        t, out = _in_background(lambda: httpx.post(url + "/update_weights_from_distributed", timeout=60, json={
            "names": [name], "dtypes": ["float32"], "shapes": [shape], "group_name": sender.group_name,
            "load_format": "flattened_bucket", "commit": False, "reset_staging": True},
            headers={"Authorization": f"Bearer {admin_token}"}))
        time.sleep(0.5)
        _assert_responsive(url, admin_token)
        t.join(DEADLINE_S * 3 + 10)
        r = out["r"]
        assert r.status_code == 400 and "re-initialise the group" in r.json()["error"], r.text
        assert time.monotonic() - t0 < DEADLINE_S * 3 + 5
        assert quick_engine.engine.weight_version == before
        assert len(quick_engine.engine.receiver._staging) == 0
    finally:
        sender._broken = "test"  # the engine left the group: do not ask it to destroy it
        sender.close()
