"""EngineClient against a real server on loopback: every failure is one EngineError that names the
engine, the route and what it answered; parallel calls wait for all and name every failure; the
extensions a client may use are those every engine advertises; the admin token travels with calls."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from miles.engine_api import routes
from miles.engine_api.client import EngineClient
from miles.engine_api.errors import EngineError
from miles.engine_api.extensions import common
from miles.net import bind, free_port, serve_app
from miles.sync.transports.base import TransportError, engine_client


def _app(extensions: list[str] | None) -> FastAPI:
    app = FastAPI()
    seen: list[dict] = []
    app.state.seen = seen

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/get_server_info")
    async def info():
        return {} if extensions is None else {"miles_extensions": extensions}

    @app.post("/pause_generation")
    async def pause(request: Request):
        seen.append({"body": await request.json(), "auth": request.headers.get("authorization")})
        return {"success": True}

    @app.post("/refuse")
    async def refuse():
        return JSONResponse({"error": "names: expected a list"}, status_code=400)

    @app.post("/broken")
    async def broken():
        return PlainTextResponse("x" * 5000, status_code=500)

    return app


@pytest.fixture(scope="module")
def engines():
    apps = [_app(ext) for ext in (["staged_commit", "p2p"], ["staged_commit"], None)]
    served = [serve_app(app, bind("127.0.0.1", 0), "127.0.0.1", what="test engine", ready_path="/health",
                        startup_timeout_s=30) for app in apps]
    yield [SimpleNamespace(url=s.url, seen=app.state.seen) for s, app in zip(served, apps)]
    for s in served:
        s.stop()


def test_a_refusal_names_the_engine_the_route_and_the_engines_reason(engines):
    url = engines[0].url
    with EngineClient(timeout_s=10) as client:
        with pytest.raises(EngineError) as err:
            client.post(url, "/refuse", {})
        e = err.value
        assert (e.url, e.path, e.status) == (url, "/refuse", 400)
        assert str(e) == f"engine {url}: /refuse returned HTTP 400: names: expected a list"
        with pytest.raises(EngineError) as err:
            client.post(url, "/broken", None)
        assert err.value.status == 500 and len(err.value.body) == 200  # an excerpt, not the whole page


def test_an_engine_that_is_not_there_is_unreachable_and_says_so():
    dead = f"http://127.0.0.1:{free_port()}"
    with EngineClient(timeout_s=5) as client:
        with pytest.raises(EngineError) as err:
            client.get(dead, routes.HEALTH)
    e = err.value
    assert e.status is None and e.unreachable and not e.timed_out and e.url == dead
    assert f"engine {dead}: /health failed to respond (ConnectError" in str(e)


def test_a_parallel_call_waits_for_every_engine_and_names_each_failure(engines):
    dead = f"http://127.0.0.1:{free_port()}"
    urls = [engines[0].url, dead, engines[1].url]
    with engine_client(None, 10) as client:
        with pytest.raises(TransportError) as err:  # a transport's client raises TransportError, an EngineError
            client.post_all(urls, routes.PAUSE_GENERATION, {"mode": "abort"})
        assert isinstance(err.value, EngineError) and dead in str(err.value)
        assert engines[0].url not in str(err.value)
    # Both live engines got the call although one failed.
    assert all(s.seen for s in engines[:2])


def test_extensions_are_those_every_engine_advertises(engines):
    with EngineClient() as client:
        assert client.extensions([e.url for e in engines[:2]]) == {"staged_commit"}
        assert client.extensions([e.url for e in engines]) == frozenset()  # a plain SGLang server has none
    assert common([]) == frozenset()


def test_admin_calls_go_to_every_serving_engine_with_the_token_and_skip_dead_ones_behind_a_router(engines):
    dead = f"http://127.0.0.1:{free_port()}"
    for s in engines:
        s.seen.clear()
    client = EngineClient([engines[0].url, dead], "sekret", router_url="http://router")
    client.each(routes.PAUSE_GENERATION, {"mode": "in_place"})
    assert engines[0].seen == [{"body": {"mode": "in_place"}, "auth": "Bearer sekret"}]
    client.set_urls([engines[1].url])
    client.each(routes.PAUSE_GENERATION, {"mode": "abort"})
    assert engines[1].seen[-1]["body"] == {"mode": "abort"}
    client.router_url = None  # without a router a dead engine is the caller's to handle
    client.set_urls([dead])
    with pytest.raises(EngineError):
        client.each(routes.PAUSE_GENERATION, {"mode": "abort"})
    client.close()


def test_async_calls_return_bytes_and_tell_a_timeout_from_an_unreachable_engine(engines):
    dead = f"http://127.0.0.1:{free_port()}"
    client = EngineClient(timeout_s=10, connect_timeout_s=5)

    async def run():
        try:
            status, body, ctype = await client.asend("GET", engines[0].url, routes.HEALTH)
            with pytest.raises(EngineError) as err:
                await client.asend("GET", dead, routes.HEALTH)
            async with client.async_http(10) as http:
                await client.wait_for_router(http, 0.1, threading.Event())  # no router: returns at the deadline
            return status, body, ctype, err.value
        finally:
            await client.aclose()

    status, body, ctype, err = asyncio.run(run())
    assert (status, body, ctype) == (200, b'{"ok":true}', "application/json")
    assert err.unreachable and not err.timed_out and err.status is None


def test_short_lived_clients_share_one_tls_context_and_still_reach_the_engine(engines, monkeypatch):
    # A weight commit opens several clients; building httpx's TLS settings (the CA bundle) for each
    # one cost 20-35 ms a client. They are built once per process now.
    import httpx

    from miles.engine_api import client as client_module

    built = []
    real = httpx.create_ssl_context
    monkeypatch.setattr(httpx, "create_ssl_context", lambda *a, **k: built.append(1) or real(*a, **k))
    client_module._tls_context.cache_clear()
    try:
        for _ in range(3):
            c = EngineClient(admin_token="tok", timeout_s=5)
            assert c.get(engines[0].url, "/health") == {"ok": True}
            c.close()
        assert len(built) == 1
    finally:
        client_module._tls_context.cache_clear()
