"""The asynchronous plumbing under EngineClient: httpx's API over aiohttp's connection pool (the
client generate functions and agents are handed), and running a batch of requests from the
synchronous methods a threaded Ray actor exposes.

Non-goals: what is requested (EngineClient in client.py; rollout's group.py, the evaluator).
"""

from __future__ import annotations

import asyncio
import threading

import httpx


# Idle connections are dropped before a uvicorn server's own keep-alive (5 s by default) would
# close them under a request.
KEEPALIVE_S = 2.0


def async_client(timeout_s: float) -> httpx.AsyncClient:
    """The client rollouts talk to engines and routers with: an httpx.AsyncClient (what generate
    functions and agents are handed), whose requests travel on aiohttp's connection pool."""
    return httpx.AsyncClient(timeout=timeout_s, transport=AiohttpTransport())


def aiohttp_session():
    """An aiohttp session as every async engine call uses it: unbounded pool, idle connections dropped
    after KEEPALIVE_S, bodies passed on undecoded (the caller decodes what the headers say). Made on
    the event loop it serves."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                                 auto_decompress=False)


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx's interface over aiohttp's connection pool.

    httpx's own async pool spends more time per request the more kept-alive connections it holds: a
    client that lives for a whole run, with a step's few hundred requests in flight, was slow to even
    start them. aiohttp's pool does not grow with them, so the client keeps the httpx API (what
    generate functions are written against) and takes aiohttp's pool. Responses stream through as
    they arrive.
    """

    def __init__(self):
        self._session = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import aiohttp

        if self._session is None:
            self._session = aiohttp_session()  # httpx decodes what the headers say
        t = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"), sock_read=t.get("read"))
        headers = [(k, v) for k, v in request.headers.multi_items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding")]
        body = await request.aread()
        try:
            r = await self._session.request(request.method, str(request.url), data=body or None, headers=headers,
                                            timeout=timeout, allow_redirects=False)
        except aiohttp.ServerTimeoutError as exc:
            raise (httpx.ConnectTimeout if "onnect" in str(exc) else httpx.ReadTimeout)(str(exc),
                                                                                        request=request) from None
        except asyncio.TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from None
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(str(exc), request=request) from None
        except aiohttp.ServerDisconnectedError as exc:
            raise httpx.RemoteProtocolError(str(exc) or "server disconnected", request=request) from None
        except aiohttp.ClientError as exc:
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}", request=request) from None
        return httpx.Response(r.status, headers=[(k, v) for k, v in r.raw_headers], stream=_Body(r, request),
                              request=request)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Body(httpx.AsyncByteStream):
    """An aiohttp response's body, piece by piece as it arrives; closing it frees the connection."""

    def __init__(self, response, request: httpx.Request):
        self._response, self._request = response, request

    async def __aiter__(self):
        import aiohttp

        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except asyncio.TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "timed out", request=self._request) from None
        except aiohttp.ClientError as exc:
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}", request=self._request) from None

    async def aclose(self) -> None:
        self._response.release()


def run_coroutine(coro):
    """asyncio.run on a fresh thread: a threaded Ray actor may call us from a thread whose event loop
    is already running, where asyncio.run refuses to start."""
    out: dict = {}

    def main():
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=main, name="rollout-io")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def run_jobs(jobs, timeout_s: float) -> list:
    """Run `job(client)` for every job concurrently on one client; results in order."""

    async def run():
        async with async_client(timeout_s) as client:
            return await asyncio.gather(*(job(client) for job in jobs))

    return run_coroutine(run())
