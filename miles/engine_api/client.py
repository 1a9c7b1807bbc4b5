"""EngineClient: every call miles makes to an engine, or to a router in front of engines.

One class for every caller, so a call to an engine fails the same way wherever it is made: with an
EngineError (errors.py) that names the engine, the route, and what the engine answered (its status
and the start of its body), or that nothing came back (timed out, or unreachable: safe to retry
elsewhere).

    sync, one engine     send (the answer, any status) · request / get / post (JSON, 200 or error)
    sync, every engine   post_all · try_all · run_all (in parallel, on the client's threads)
                         each · memory (in turn, over the serving set `urls`, which follows set_urls)
    negotiation          extensions (what every engine advertises, extensions.py)
    probes               health · weight_version (liveness is decided in rollout/liveness.py)
    async                async_http (the httpx client generate functions are handed, aio.py)
                         asend · astream (bytes in, bytes out: the router's proxying)
                         abort_all · abort_rids · wait_for_router (a rollout's own calls)

Who calls what: the weight transports and the updater (sync/) post in parallel and negotiate
extensions; the fleet and the driver probe and call the router; the rollout pauses, resumes and
releases memory engine by engine and aborts its requests; the router proxies.
The admin token, when given, goes with every call as `Authorization: Bearer`; a client without one
sends none (generation and probes need none).
Non-goals: what a body holds (parsing.py, bodies.py) and what to do about a failure (the caller's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import threading
import time
from collections.abc import Iterable
from contextlib import asynccontextmanager
from typing import Callable, Literal

from miles.engine_api import routes
from miles.engine_api.errors import EngineError
from miles.engine_api.extensions import common
from miles.net import bearer_headers


class EngineClient:
    """Calls to engines: sync (pooled connections, a thread per engine for parallel calls) and async
    (aiohttp's pool, on the event loop that first uses it).

    urls: the serving engines that `each` and `memory` call in turn; router_url: the router in front
    of them, if any (a call that finds an engine dead is then skipped: the router routes around it
    and the fleet replaces it). timeout_s bounds a whole call, connect_timeout_s its connect (sync and
    the router's async calls); `error`: the EngineError subclass raised (the weight transports raise
    TransportError). Connections and threads are made at first use."""

    def __init__(self, urls: Iterable[str] = (), admin_token: str | None = None, timeout_s: float = 120.0, *,
                 router_url: str | None = None, connect_timeout_s: float = 10.0,
                 error: type[EngineError] = EngineError):
        self.urls = list(urls)
        self.router_url = router_url
        self.headers = bearer_headers(admin_token)
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.error = error
        self._lock = threading.Lock()
        self._http = None  # httpx.Client
        self._pool: cf.ThreadPoolExecutor | None = None
        self._session = None  # aiohttp.ClientSession, bound to the event loop that made it

    def set_urls(self, urls: Iterable[str]) -> None:
        """The serving engines changed (one replaced, added or removed); `each` and `memory` follow them."""
        self.urls = list(urls)

    # ---- sync, one engine -----------------------------------------------------------------------

    def send(self, method: str, url: str, path: str, body: dict | None = None, *, timeout: float | None = None,
             params: dict | None = None):
        """One call (no body at all when `body` is None); the engine's answer (an httpx.Response) whatever
        its status, or `error` when none came back. `timeout` replaces every part of the client's."""
        import httpx

        kwargs: dict = {}
        if body is not None:
            kwargs["json"] = body
        if params is not None:
            kwargs["params"] = params
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            return self._client().request(method, url + path, **kwargs)
        except httpx.HTTPError as exc:
            raise self.error.no_answer(url, path, exc, timed_out=isinstance(exc, httpx.TimeoutException),
                                       unreachable=isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError))
                                       ) from None

    def request(self, method: str, url: str, path: str, body: dict | None = None, *, timeout: float | None = None,
                params: dict | None = None):
        """The JSON answer ({"message": text} for SGLang's plain-text ones, e.g. /flush_cache), or `error`
        naming the engine, the route and the engine's reason when it did not answer 200."""
        r = self.send(method, url, path, body, timeout=timeout, params=params)
        if r.status_code != 200:
            try:
                answer = r.json()
                reason = (answer.get("error") or answer.get("message")) if isinstance(answer, dict) else None
            except ValueError:
                reason = None
            raise self.error.answered(url, path, r.status_code, r.text, reason)
        try:
            return r.json()
        except ValueError:
            return {"message": r.text}

    def get(self, url: str, path: str, *, timeout: float | None = None):
        return self.request("GET", url, path, timeout=timeout)

    def post(self, url: str, path: str, body: dict | None, *, timeout: float | None = None):
        """POST `body` (no body at all when None); the JSON answer or `error`."""
        return self.request("POST", url, path, body, timeout=timeout)

    # ---- sync, every engine -----------------------------------------------------------------------

    def post_all(self, urls: list[str], path: str, body: dict | Callable[[int, str], dict] | None,
                 method: str = "POST") -> list:
        """Call every engine at once (body may depend on (index, url)); every answer, in order. Waits for
        all before raising one `error` naming every engine that failed (none is left mid-request)."""
        futures = [self._threads().submit(self.request, method, url, path, body(i, url) if callable(body) else body)
                   for i, url in enumerate(urls)]
        cf.wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise self.error.of_many(errors)
        return [f.result() for f in futures]

    def try_all(self, urls: list[str], path: str, body: dict | None) -> list:
        """POST to every engine at once; each one's answer, or the error it raised (nothing raised)."""
        futures = [self._threads().submit(self.request, "POST", url, path, body) for url in urls]
        cf.wait(futures)
        return [f.exception() if f.exception() is not None else f.result() for f in futures]

    def run_all(self, fns: list[Callable[[], object]]) -> list:
        """Run callables concurrently on the client's threads; raise the first error after all finish."""
        futures = [self._threads().submit(fn) for fn in fns]
        cf.wait(futures)
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futures]

    def each(self, path: str, body: dict) -> None:
        """POST `body` to `path` of every serving engine, one after the other (pause_generation,
        continue_generation, ...). Behind a router an engine that does not answer is skipped: the
        fleet replaces it, and its replacement starts unpaused."""
        for url in list(self.urls):
            try:
                self.request("POST", url, path, body)
            except EngineError as exc:
                if exc.status is not None or self.router_url is None:
                    raise

    def memory(self, action: Literal["release", "resume"], tags: list[str] | None = None) -> bool:
        """Ask every serving engine to release (or take back) its memory, the kinds in `tags` (None: all);
        False when they do not offer it."""
        path = routes.RELEASE_MEMORY if action == "release" else routes.RESUME_MEMORY
        body = {} if tags is None else {"tags": list(tags)}
        ok = True
        for url in self.urls:
            r = self.send("POST", url, path, body)
            if r.status_code == 404:
                ok = False
            elif r.status_code != 200:
                raise self.error.answered(url, path, r.status_code, r.text)
        return ok

    # ---- negotiation and probes ---------------------------------------------------------------------

    def extensions(self, urls: list[str]) -> frozenset[str]:
        """The miles extensions every one of `urls` offers (none if any is a plain SGLang server)."""
        return common(self.post_all(urls, routes.GET_SERVER_INFO, None, method="GET"))

    def health(self, url: str, timeout: float) -> bool:
        """Whether the engine's server answers /health with 200 within `timeout`."""
        try:
            return self.send("GET", url, routes.HEALTH, timeout=timeout).status_code == 200
        except EngineError:
            return False

    def weight_version(self, url: str, timeout: float):
        """The engine's weight version (SGLang's string), or None when it cannot be read now."""
        try:
            return self.send("GET", url, routes.GET_MODEL_INFO, timeout=timeout).json().get("weight_version")
        except Exception:  # noqa: BLE001 - unreadable now (no answer, not JSON); the caller reads it again later
            return None

    # ---- async ----------------------------------------------------------------------------------------

    @staticmethod
    def async_http(timeout_s: float):
        """A fresh httpx.AsyncClient on aiohttp's pool, for one event loop: what generate functions and
        agents are handed, and what abort_all, abort_rids and wait_for_router send on."""
        from miles.engine_api import aio  # loads httpx, which loading a run config (it reaches this module) must not

        return aio.async_client(timeout_s)

    async def asend(self, method: str, url: str, path: str, body: bytes | None = None, headers: dict | None = None,
                    timeout: float | None = None) -> tuple[int, bytes, str | None]:
        """One call, bytes out and bytes back: (status, body, content type), or `error` (timed_out or
        unreachable) when the engine never answered."""
        import aiohttp

        session = self._async_session()
        timeout = aiohttp.ClientTimeout(total=timeout or self.timeout_s, connect=self.connect_timeout_s)
        for attempt in (0, 1):
            try:
                async with session.request(method, url + path, data=body, headers=headers, timeout=timeout) as r:
                    return r.status, await r.read(), r.headers.get("content-type")
            except asyncio.TimeoutError as exc:
                raise self.error.no_answer(url, path, exc, timed_out=True, unreachable=False) from None
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                # Most often a pooled keep-alive connection the server had just closed: one more try
                # on a fresh connection. A dead engine then refuses the connection outright.
                if attempt:
                    raise self.error.no_answer(url, path, exc, timed_out=False, unreachable=True) from None
            except aiohttp.ClientError as exc:
                raise self.error.no_answer(url, path, exc, timed_out=False, unreachable=True) from None

    @asynccontextmanager
    async def astream(self, url: str, path: str, body: bytes, headers: dict | None = None):
        """POST `body`; yields (status, content type, async iterator of the body's pieces as they come).
        `error` (timed_out or unreachable) when the engine never answered; a failure midway ends the
        iterator with an error."""
        import aiohttp

        try:
            r = await self._async_session().request(
                "POST", url + path, data=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, connect=self.connect_timeout_s))
        except asyncio.TimeoutError as exc:
            raise self.error.no_answer(url, path, exc, timed_out=True, unreachable=False) from None
        except aiohttp.ClientError as exc:
            raise self.error.no_answer(url, path, exc, timed_out=False, unreachable=True) from None
        try:
            yield r.status, r.headers.get("content-type"), r.content.iter_any()
        finally:
            r.release()

    async def abort_all(self, http) -> None:
        """Abort every request on every serving engine, on `http` (an async_http client); best effort."""
        for url in self.urls:
            try:
                await http.post(f"{url}{routes.ABORT_REQUEST}", json={"abort_all": True}, timeout=2,
                                headers=self.headers)
            except Exception:  # noqa: BLE001 - an unreachable engine has nothing in flight to abort
                pass

    @staticmethod
    async def abort_rids(http, url: str, rids: list[str]) -> None:
        """Abort the requests `rids` at `url` (a client may abort its own, so no token); best effort."""
        async def one(rid):
            try:
                await http.post(f"{url}{routes.ABORT_REQUEST}", json={"rid": rid}, timeout=2)
            except Exception:  # noqa: BLE001 - best effort: the engine may be the thing that failed
                pass

        # Short and concurrent: a hung engine must not hold the caller much past its timeout.
        await asyncio.gather(*(one(r) for r in rids))

    async def wait_for_router(self, http, timeout_s: float, stopping: threading.Event) -> None:
        """Wait until the router has an engine to serve (all may be being replaced), at most `timeout_s`
        or until `stopping` is set, so a retry is not spent at once on the same failure."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stopping.is_set():
            try:
                if (await http.get(f"{self.router_url}{routes.HEALTH}", timeout=5)).status_code == 200:
                    return
            except Exception:  # noqa: BLE001 - the router itself unreachable: keep waiting until the deadline
                pass
            await asyncio.sleep(0.5)

    async def aclose(self) -> None:
        """Close the async connections (their event loop is ending)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- connections ----------------------------------------------------------------------------------

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the sync connections and threads; the client makes new ones if used again."""
        with self._lock:
            http, pool, self._http, self._pool = self._http, self._pool, None, None
        if http is not None:
            http.close()
        if pool is not None:
            pool.shutdown(wait=False)

    def _client(self):
        if self._http is None:
            import httpx

            with self._lock:
                if self._http is None:
                    self._http = httpx.Client(headers=self.headers, verify=_tls_context(),
                                              timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s))
        return self._http

    def _threads(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="miles-engine-http")
        return self._pool

    def _async_session(self):
        if self._session is None:
            from miles.engine_api import aio  # as in async_http

            self._session = aio.aiohttp_session()
        return self._session


@functools.cache
def _tls_context():
    """httpx's default TLS settings, made once per process: building them (the CA bundle) takes 20-35 ms,
    which every short-lived client (a weight commit makes several) would otherwise pay again."""
    import httpx

    return httpx.create_ssl_context()
