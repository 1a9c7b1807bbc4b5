"""The rollout's HTTP client is an httpx.AsyncClient (what generate functions and agents are handed)
whose requests travel on aiohttp's pool: httpx's requests, responses, streams and errors, against a
real server on loopback."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from miles.net import bind, free_port, serve_app
from miles.engine_api.aio import async_client


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"got": body, "auth": request.headers.get("authorization")}, status_code=201,
                            headers={"x-seen": "1"})

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(3)
        return {"late": True}

    @app.get("/stream")
    async def stream():
        async def pieces():
            for i in range(3):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.3)

        return StreamingResponse(pieces(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server():
    served = serve_app(_app(), bind("127.0.0.1", 0), "127.0.0.1", what="test server", ready_path="/health",
                       startup_timeout_s=30)
    yield served.url
    served.stop()


def _run(coro):
    return asyncio.run(coro)


def test_requests_and_responses_keep_httpx_semantics(server):
    async def go():
        async with async_client(30) as client:
            assert isinstance(client, httpx.AsyncClient)
            r = await client.post(f"{server}/echo", json={"ids": [1, 2, 3]}, headers={"Authorization": "Bearer t"})
            assert r.status_code == 201 and r.headers["x-seen"] == "1"
            assert r.json() == {"got": {"ids": [1, 2, 3]}, "auth": "Bearer t"}
            missing = await client.get(f"{server}/nowhere")
            assert missing.status_code == 404
            with pytest.raises(httpx.HTTPStatusError):
                missing.raise_for_status()
            # Many at once on the same pool, then again on its kept-alive connections.
            for _ in range(2):
                replies = await asyncio.gather(*(client.post(f"{server}/echo", json={"i": i}) for i in range(200)))
                assert [r.json()["got"]["i"] for r in replies] == list(range(200))

    _run(go())


def test_a_streamed_response_arrives_piece_by_piece(server):
    async def go():
        async with async_client(30) as client:
            loop = asyncio.get_running_loop()
            t0, seen = loop.time(), []
            async with client.stream("GET", f"{server}/stream") as r:
                async for line in r.aiter_lines():
                    if line:
                        seen.append((line, loop.time() - t0))
            assert [s for s, _ in seen] == ["data: 0", "data: 1", "data: 2"]
            assert seen[0][1] < seen[-1][1] - 0.3  # the first piece came before the last was written

    _run(go())


def test_failures_raise_httpxs_own_errors(server):
    async def go():
        async with async_client(30) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{free_port()}/health")  # nobody listens there
            with pytest.raises(httpx.TimeoutException):
                await client.get(f"{server}/slow", timeout=0.5)
            assert (await client.get(f"{server}/health")).json() == {"ok": True}  # the pool still works

    _run(go())


def test_request_bodies_are_sent_as_given(server):
    async def go():
        async with async_client(30) as client:
            raw = json.dumps({"text": "é" * 10_000}).encode()
            r = await client.post(f"{server}/echo", content=raw, headers={"content-type": "application/json"})
            assert r.json()["got"] == {"text": "é" * 10_000}

    _run(go())
