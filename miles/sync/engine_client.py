"""The trainer's HTTP client for engines' admin endpoints: one call per engine, in parallel.

Every failure becomes a TransportError that names the engine, the endpoint and the engine's own
reason, and a call to several engines waits for all of them before raising one error naming every
engine that failed (so no engine is left mid-request when the caller reacts).

Extensions: what an engine offers beyond SGLang's protocol is read from its /get_server_info
(`miles_extensions`); a plain SGLang server has none, and the trainer uses an extension only where
every engine advertises it.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Callable

from miles.net import bearer_headers
from miles.sync.transports.base import TransportError


def reconnect(transport, engine_urls: list[str], timeout_s: float) -> EngineClient:
    """How an HTTP transport's `connect` begins: refuse an empty engine list, close what an earlier
    connect opened, keep the URLs (no trailing slash) as `transport.engine_urls`, and return a fresh
    client carrying the transport's admin token."""
    if not engine_urls:
        raise ValueError("connect: no engine URLs given")
    transport.close()
    transport.engine_urls = [u.rstrip("/") for u in engine_urls]
    return EngineClient(transport.admin_token, timeout_s)


class EngineClient:
    def __init__(self, admin_token: str | None = None, timeout_s: float = 120.0):
        import httpx

        self._http = httpx.Client(headers=bearer_headers(admin_token), timeout=httpx.Timeout(timeout_s, connect=10))
        self._pool = cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="miles-sync-http")

    def get(self, url: str, path: str) -> dict:
        return self.request("GET", url, path)

    def extensions(self, urls: list[str]) -> frozenset[str]:
        """The miles extensions every one of `urls` offers (none if any is a plain SGLang server)."""
        offered = None
        for info in self.post_all(urls, "/get_server_info", None, method="GET"):
            mine = info.get("miles_extensions")
            mine = frozenset(mine) if isinstance(mine, list) else frozenset()
            offered = mine if offered is None else offered & mine
        return offered or frozenset()

    def post(self, url: str, path: str, body: dict | None) -> dict:
        """POST `body` (no body at all when None); returns the reply or raises TransportError."""
        return self.request("POST", url, path, body)

    def request(self, method: str, url: str, path: str, body: dict | None = None) -> dict:
        """The JSON reply ({"message": text} for SGLang's plain-text ones, e.g. /flush_cache), or
        TransportError naming the engine, the route and the engine's reason."""
        import httpx

        try:
            r = self._http.request(method, url + path, json=body) if body is not None else \
                self._http.request(method, url + path)
        except httpx.HTTPError as exc:
            raise TransportError(f"engine {url}: {path} failed to respond ({type(exc).__name__}: {exc})") from None
        if r.status_code != 200:
            try:
                reason = r.json().get("error") or r.json().get("message") or r.text
            except ValueError:
                reason = r.text
            raise TransportError(f"engine {url}: {path} returned HTTP {r.status_code}: {reason}")
        try:
            return r.json()
        except ValueError:
            return {"message": r.text}

    def post_all(self, urls: list[str], path: str, body: dict | Callable[[int, str], dict] | None,
                 method: str = "POST") -> list[dict]:
        """POST to every engine at once (body may depend on (index, url)); raise naming every failure."""
        futures = [self._pool.submit(self.request, method, url, path, body(i, url) if callable(body) else body)
                   for i, url in enumerate(urls)]
        cf.wait(futures)
        errors = [str(f.exception()) for f in futures if f.exception() is not None]
        if errors:
            raise TransportError("; ".join(errors))
        return [f.result() for f in futures]

    def try_all(self, urls: list[str], path: str, body: dict | None) -> list:
        """POST to every engine at once; each one's reply, or the TransportError it raised (nothing raised)."""
        futures = [self._pool.submit(self.request, "POST", url, path, body) for url in urls]
        cf.wait(futures)
        return [f.exception() if f.exception() is not None else f.result() for f in futures]

    def run_all(self, fns: list[Callable[[], object]]) -> list:
        """Run callables concurrently on the client's threads; raise the first error after all finish."""
        futures = [self._pool.submit(fn) for fn in fns]
        cf.wait(futures)
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futures]

    def close(self) -> None:
        self._http.close()
        self._pool.shutdown(wait=False)
