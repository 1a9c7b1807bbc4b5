"""The router's HTTP client to its engines: one request out, (status, body, content type) back, and
two failures told apart: the engine never answered (safe to retry elsewhere) or it took too long.

A streamed answer (`stream`) is handed on piece by piece as the engine sends it.
Non-goals: choosing the engine (policy.py) and serving clients (app.py).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class Unreachable(Exception):
    """The engine could not be reached or dropped the connection before answering."""


class TimedOut(Exception):
    """The engine took longer than the request timeout."""


class Upstream:
    """HTTP client to the engines: aiohttp where installed (several times less CPU per request than
    httpx, which matters when hundreds of requests pass through one Python process), else httpx."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        try:
            import aiohttp
        except ImportError:
            aiohttp = None
        self._aiohttp = aiohttp
        self._session = None

    async def request(self, method: str, url: str, body: bytes | None = None, headers: dict | None = None,
                      timeout: float | None = None) -> tuple[int, bytes, str | None]:
        timeout = timeout or self.timeout_s
        if self._aiohttp is not None:
            return await self._via_aiohttp(method, url, body, headers, timeout)
        return await self._via_httpx(method, url, body, headers, timeout)

    async def _via_aiohttp(self, method, url, body, headers, timeout):
        aiohttp = self._aiohttp
        if self._session is None:
            # Idle connections are dropped before uvicorn's 5 s keep-alive would close them under us.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0), auto_decompress=False)
        for attempt in (0, 1):
            try:
                async with self._session.request(method, url, data=body, headers=headers,
                                                 timeout=aiohttp.ClientTimeout(total=timeout, connect=5.0)) as r:
                    return r.status, await r.read(), r.headers.get("content-type")
            except asyncio.TimeoutError:
                raise TimedOut() from None
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                # Most often a pooled keep-alive connection the server had just closed: one more try
                # on a fresh connection. A dead engine then refuses the connection outright.
                if attempt:
                    raise Unreachable(f"{type(exc).__name__}: {exc}") from None
            except aiohttp.ClientError as exc:
                raise Unreachable(f"{type(exc).__name__}: {exc}") from None

    async def _via_httpx(self, method, url, body, headers, timeout):
        import httpx

        if self._session is None:
            self._session = httpx.AsyncClient(limits=httpx.Limits(max_connections=4096,
                                                                  max_keepalive_connections=256))
        try:
            r = await self._session.request(method, url, content=body, headers=headers,
                                            timeout=httpx.Timeout(timeout, connect=5.0, pool=None))
            return r.status_code, r.content, r.headers.get("content-type")
        except httpx.TimeoutException:
            raise TimedOut() from None
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None

    @asynccontextmanager
    async def stream(self, url: str, body: bytes, headers: dict | None = None):
        """POST `body`; yields (status, content type, async iterator of the body's pieces as they come).
        Unreachable or TimedOut when the engine never answered; a failure midway ends the iterator
        with an error."""
        if self._aiohttp is not None:
            aiohttp = self._aiohttp
            if self._session is None:
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0), auto_decompress=False)
            try:
                r = await self._session.request("POST", url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(
                    total=self.timeout_s, connect=5.0))
            except asyncio.TimeoutError:
                raise TimedOut() from None
            except aiohttp.ClientError as exc:
                raise Unreachable(f"{type(exc).__name__}: {exc}") from None
            try:
                yield r.status, r.headers.get("content-type"), r.content.iter_any()
            finally:
                r.release()
            return
        import httpx

        if self._session is None:
            self._session = httpx.AsyncClient(limits=httpx.Limits(max_connections=4096,
                                                                  max_keepalive_connections=256))
        try:
            request = self._session.build_request("POST", url, content=body, headers=headers,
                                                  timeout=httpx.Timeout(self.timeout_s, connect=5.0, pool=None))
            r = await self._session.send(request, stream=True)
        except httpx.TimeoutException:
            raise TimedOut() from None
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None
        try:
            yield r.status_code, r.headers.get("content-type"), r.aiter_raw()
        finally:
            await r.aclose()

    async def close(self) -> None:
        if self._session is not None:
            await (self._session.close() if self._aiohttp is not None else self._session.aclose())
            self._session = None
