"""The Rust sglang-router (router.kind = "sglang") in front of built-in engines."""

from __future__ import annotations

import time

import httpx
import pytest

from miles.net import free_port


BODY = {"input_ids": list(range(4, 20)), "return_logprob": True, "rid": "sg-1",
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}


@pytest.fixture(scope="module")
def sglang_router(engines):
    """The Rust router in front of both engines, once it serves /generate: (url, its first reply)."""
    pytest.importorskip("sglang_router")
    from miles.rollout.router import RouterConfig, launch_sglang_router

    port = free_port()
    proc = launch_sglang_router(RouterConfig(kind="sglang"), [e.url for e in engines], port)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline, r = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                r = httpx.post(url + "/generate", json=BODY, timeout=30)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        assert r is not None and r.status_code == 200, r.text if r is not None else "router never answered"
        yield url, r
    finally:
        proc.terminate()
        proc.wait(15)


def test_sglang_router_serves_built_in_engines(engines, sglang_router):
    url, r = sglang_router
    body = BODY
    direct = httpx.post(engines[0].url + "/generate", json=body, timeout=60).json()
    out = r.json()
    assert out["output_ids"] == direct["output_ids"]
    # The ids exactly; the values to float32 noise, as the two calls may be served by different
    # engines with and without a cached prefix.
    got, want = out["meta_info"]["output_token_logprobs"], direct["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in got] == [t for _, t, _ in want]
    assert all(abs(a[0] - b[0]) < 1e-5 for a, b in zip(got, want))
    assert out["meta_info"]["weight_version"] == "default"
    many = [httpx.post(url + "/generate", json={**body, "rid": f"sg-{i}"}, timeout=60) for i in range(6)]
    assert all(m.status_code == 200 and m.json()["output_ids"] == direct["output_ids"] for m in many)


def test_rollout_behind_the_sglang_router_needs_one_prompt_per_request(tiny_model_dir, sglang_router, caplog):
    """The Rust router takes one prompt per /generate: with rollout.batch_requests (the default) a
    group fails with a warning that names the setting; with it off the same group is generated."""
    from miles.buffer.data_buffer import BufferConfig
    from miles.rollout.config import RolloutConfig
    from miles.rollout.manager import RolloutManager

    url, _ = sglang_router

    def manager(batch: bool):
        cfg = RolloutConfig(prompts_per_step=1, n_samples_per_prompt=3, max_new_tokens=6, batch_requests=batch)
        return RolloutManager(cfg, tiny_model_dir, [url], seed=0,
                              buffer_cfg=BufferConfig(filter="none", on_failure="drop"))

    with caplog.at_level("WARNING", logger="miles.rollout.group"):
        m = manager(True)
        m.generate_batch()
    assert m.buffer.ledger.events["discarded_engine_failure"] == 1, dict(m.buffer.ledger.events)
    assert "rollout.batch_requests = false" in caplog.text

    m = manager(False)
    m.generate_batch()
    groups, _ = m.collect(1, timeout=60)
    assert len(groups) == 1 and len(groups[0].samples) == 3
    assert all(len(s.response_ids) == 6 for s in groups[0].samples)
