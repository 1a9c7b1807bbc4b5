"""The Rust sglang-router (router.kind = "sglang") in front of built-in engines."""

from __future__ import annotations

import socket
import time

import httpx
import pytest


def test_sglang_router_serves_built_in_engines(engines):
    pytest.importorskip("sglang_router")
    from miles.rollout.router import RouterConfig, launch_sglang_router

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    body = {"input_ids": list(range(4, 20)), "return_logprob": True, "rid": "sg-1",
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    direct = httpx.post(engines[0].url + "/generate", json=body, timeout=60).json()
    proc = launch_sglang_router(RouterConfig(kind="sglang"), [e.url for e in engines], port)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline, r = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                r = httpx.post(url + "/generate", json=body, timeout=30)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        assert r is not None and r.status_code == 200, r.text if r is not None else "router never answered"
        out = r.json()
        assert out["output_ids"] == direct["output_ids"]
        # The ids exactly; the values to float32 noise, as the two calls may be served by different
        # engines with and without a cached prefix.
        got, want = out["meta_info"]["output_token_logprobs"], direct["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert all(abs(a[0] - b[0]) < 1e-5 for a, b in zip(got, want))
        assert out["meta_info"]["weight_version"] == 0
        many = [httpx.post(url + "/generate", json={**body, "rid": f"sg-{i}"}, timeout=60) for i in range(6)]
        assert all(m.status_code == 200 and m.json()["output_ids"] == direct["output_ids"] for m in many)
    finally:
        proc.terminate()
        proc.wait(15)
