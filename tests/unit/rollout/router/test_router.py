"""The built-in router over real engine processes: spreading load, stickiness, transparency, bad input."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from miles.net import bind, free_port, serve_app


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _body(ids, n=8):
    return {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}


async def _wave(url: str, prompts: list[list[int]], count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=1000)) as c:
        return await asyncio.gather(*(c.post("/generate", json=_body(prompts[i % len(prompts)]))
                                      for i in range(count)))


def test_hundreds_of_concurrent_requests_spread_without_errors_or_growth(router, engines):
    prompts = [list(range(5 + i, 25 + i)) for i in range(10)]
    with httpx.Client(timeout=60) as c:
        direct = [c.post(engines[0].url + "/generate", json=_body(p)).json() for p in prompts]
    served0 = {u: w.served for u, w in router.router.workers.items()}

    first = asyncio.run(_wave(router.url, prompts, 200))
    rss_after_first = [_rss_mb(e.proc.pid) for e in engines]
    second = asyncio.run(_wave(router.url, prompts, 200))
    rss_after_second = [_rss_mb(e.proc.pid) for e in engines]

    for i, r in enumerate(first + second):
        assert r.status_code == 200, r.text
        out, ref = r.json(), direct[i % len(prompts)]
        assert out["output_ids"] == ref["output_ids"]
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == ref["output_ids"]
    served = {u: w.served - served0[u] for u, w in router.router.workers.items()}
    assert sum(served.values()) == 400 and min(served.values()) >= 100, served
    assert all(w.outstanding == 0 for w in router.router.workers.values())
    # A second identical wave must not leave the engines holding more memory (no per-request leak).
    for before, after in zip(rss_after_first, rss_after_second):
        assert after - before < 40, (rss_after_first, rss_after_second)


def test_routing_key_sticks_to_one_engine(router):
    workers = router.router.workers
    before = {u: w.served for u, w in workers.items()}
    with httpx.Client(base_url=router.url, timeout=60) as c:
        for turn in range(6):
            r = c.post("/generate", json=_body(list(range(3, 10 + turn)), 2), headers={"X-Routing-Key": "episode-7"})
            assert r.status_code == 200
        delta = sorted(w.served - before[u] for u, w in workers.items())
        assert delta == [0, 6]
        # Without a key, sequential requests alternate (least outstanding, ties round-robin).
        before = {u: w.served for u, w in workers.items()}
        for _ in range(4):
            c.post("/generate", json=_body([3, 4, 5], 1))
        assert sorted(w.served - before[u] for u, w in workers.items()) == [2, 2]


def test_proxy_keeps_every_request_and_response_field_byte_for_byte():
    """An engine at the edge that records what arrives and answers fields the router has never heard of."""
    from miles.rollout.router import RouterConfig, start_router_thread

    answer = json.dumps({"text": "x", "output_ids": [1, 2], "meta_info": {
        "routed_experts": [[[0, 3], [1, 2]]], "weight_version": "7", "output_token_logprobs": [[-0.5, 1, None]],
        "some_future_field": {"nested": [1.5, None]}}}).encode()
    seen: list[bytes] = []
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        seen.append(await request.body())
        return Response(answer, media_type="application/json")

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/get_model_info")
    async def version():
        return {"weight_version": "7"}

    edge = serve_app(app, bind("127.0.0.1", 0), "127.0.0.1", what="edge engine", ready_path="/health",
                     startup_timeout_s=30, log_level="error", lifespan="off")
    r = start_router_thread(RouterConfig(), [edge.url])
    try:
        sent = b'{"input_ids": [1, 2], "return_routed_experts": true, "custom": {"a": [1, 2.50]}}'
        resp = httpx.post(r.url + "/generate", content=sent, headers={"content-type": "application/json"})
        assert resp.status_code == 200
        assert resp.content == answer
        assert seen == [sent]
        assert httpx.get(r.url + "/get_weight_version").json() == {"weight_version": "7"}
    finally:
        r.stop()
        edge.stop()


def test_engine_errors_pass_through_unchanged(router):
    r = httpx.post(router.url + "/generate", json={"input_ids": [10**9]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]


def test_no_reachable_engine_gives_503_naming_the_cause():
    from miles.rollout.liveness import HealthConfig
    from miles.rollout.router import RouterConfig, start_router_thread

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    r = start_router_thread(RouterConfig(), [dead], HealthConfig(interval_s=60))
    try:
        resp = httpx.post(r.url + "/generate", json={"input_ids": [1]})
        assert resp.status_code == 503
        assert "no engine could serve" in resp.json()["error"]
    finally:
        r.stop()


def test_worker_membership_needs_the_token_and_a_valid_url(engines):
    from miles.rollout.router import RouterConfig, start_router_thread

    r = start_router_thread(RouterConfig(admin_token="rt"), [engines[0].url])
    auth = {"Authorization": "Bearer rt"}
    try:
        assert httpx.post(r.url + "/add_worker", params={"url": engines[1].url}).status_code == 401
        assert httpx.post(r.url + "/add_worker", params={"url": "ftp://x"}, headers=auth).status_code == 400
        assert httpx.post(r.url + "/add_worker", params={"url": engines[1].url}, headers=auth).status_code == 200
        listed = httpx.get(r.url + "/list_workers").json()["workers"]
        assert [w["quarantined"] for w in listed] == [False, False]  # passed its health check on arrival
        assert httpx.post(r.url + "/remove_worker", params={"url": engines[1].url}, headers=auth).status_code == 200
        assert httpx.get(r.url + "/list_workers").json()["urls"] == [engines[0].url]
        assert httpx.post(r.url + "/remove_worker", params={"url": engines[1].url}, headers=auth).status_code == 404
    finally:
        r.stop()


def test_readmission_waits_for_the_current_weight_version():
    from miles.rollout.liveness import HealthConfig
    from miles.rollout.router import Router, RouterConfig

    router = Router(RouterConfig(), ["http://a:1", "http://b:1"], HealthConfig(failure_threshold=2))
    a, b = router.workers["http://a:1"], router.workers["http://b:1"]
    router.record_health(a, 3)
    router.record_health(b, 3)
    router.record_failure(b, "boom")
    assert not b.quarantined
    router.record_failure(b, "boom")
    assert b.quarantined and router.pick(None, set()) is a
    router.record_health(b, 2)  # back up, but restarted from older weights
    assert b.quarantined
    router.record_health(b, 3)
    assert not b.quarantined


def test_config_refusals_name_the_fix():
    from miles.config import ConfigError
    from miles.rollout.router import RouterConfig

    with pytest.raises(ConfigError, match="router.kind"):
        RouterConfig(kind="nginx").validate()
    with pytest.raises(ConfigError, match="routed experts"):
        RouterConfig(kind="sglang").check_features(return_routed_experts=True)
    RouterConfig(kind="miles").check_features(return_routed_experts=True)


def test_a_streamed_answer_passes_through_piece_by_piece():
    """An edge engine that streams one chunk, then waits: the client already holds that chunk, through
    the router, while the engine has not sent the rest; then the whole stream arrives unchanged."""
    import threading

    from fastapi.responses import StreamingResponse

    from miles.rollout.liveness import HealthConfig
    from miles.rollout.router import RouterConfig, start_router_thread

    release = threading.Event()
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        async def chunks():
            yield b'data: {"output_ids": [1]}\n\n'
            await asyncio.to_thread(release.wait, 30)
            yield b'data: {"output_ids": [1, 2]}\n\ndata: [DONE]\n\n'
        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/get_model_info")
    async def version():
        return {"weight_version": "1"}

    edge = serve_app(app, bind("127.0.0.1", 0), "127.0.0.1", what="edge engine", ready_path="/health",
                     startup_timeout_s=30, log_level="error", lifespan="off")
    r = start_router_thread(RouterConfig(), [edge.url])
    dead = start_router_thread(RouterConfig(), [f"http://127.0.0.1:{free_port()}"], HealthConfig(interval_s=60))
    try:
        with httpx.stream("POST", r.url + "/generate", json={"input_ids": [1], "stream": True}, timeout=60) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = resp.iter_lines()
            assert next(lines) == 'data: {"output_ids": [1]}'
            assert not release.is_set()  # the engine is still holding the rest
            release.set()
            assert [ln for ln in lines if ln] == ['data: {"output_ids": [1, 2]}', "data: [DONE]"]
        # No engine to stream from: the same 503 naming the cause as an unstreamed request.
        resp = httpx.post(dead.url + "/generate", json={"input_ids": [1], "stream": True})
        assert resp.status_code == 503 and "no engine could serve" in resp.json()["error"]
    finally:
        release.set()
        dead.stop()
        r.stop()
        edge.stop()
