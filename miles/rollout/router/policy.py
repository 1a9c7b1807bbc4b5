"""Routing policy: which engine serves a request, and when an engine may serve at all.

Selection is least-outstanding-requests: each request goes to the active engine with the fewest
requests this router has in flight there (ties are broken round-robin). A request that carries a
routing key (header `X-Routing-Key` by default) sticks to the engine that served that key before, so
a multi-turn episode returns to the engine holding its prefix KV; if that engine is quarantined the
key moves.

Liveness (the `health` section and its probes, shared with the engine fleet, rollout/liveness.py):
every `interval_s` each engine's /health and /get_model_info (its weight_version) are read. After `failure_threshold` consecutive failures (health
checks or requests that failed before an answer) an engine is quarantined: it gets no new requests.
It is re-admitted once healthy again AND at the fleet's current weight version, so an engine that
restarted from an old checkpoint cannot serve stale weights. A request whose engine fails before
answering (connection refused or reset) is retried on another engine; a timeout is not retried,
because the first engine may still be generating.

Proxying is transparent: the request body goes out byte for byte and the engine's response (status,
body) comes back byte for byte, so every field survives (logprobs, weight versions, routed experts).
A streamed request (`stream: true`) is chosen and retried the same way, and its answer is handed on
as the engine sends it (proxy_stream).
Non-goals: HTTP serving (app.py), prefill/decode disaggregation, cache-aware (radix) routing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass

from miles.engine_api.client import EngineClient
from miles.engine_api.errors import EngineError
from miles.net import bearer_headers
from miles.rollout.liveness import HealthConfig, Liveness
from miles.rollout.router.config import RouterConfig, check_url

log = logging.getLogger(__name__)

_MAX_STICKY_KEYS = 100_000


@dataclass
class Worker:
    url: str
    outstanding: int = 0
    served: int = 0
    failures: int = 0  # consecutive
    quarantined: bool = False
    weight_version: int | None = None
    last_error: str | None = None

    def public(self) -> dict:
        return {"url": self.url, "outstanding": self.outstanding, "served": self.served,
                "failures": self.failures, "quarantined": self.quarantined,
                "weight_version": self.weight_version, "last_error": self.last_error}


@dataclass
class _Counters:
    requests: int = 0
    retries: int = 0
    failures: int = 0
    quarantines: int = 0
    readmissions: int = 0
    unavailable: int = 0
    sticky_hits: int = 0


class Router:
    """The routing state and its policies; `build_app` puts HTTP in front of it."""

    def __init__(self, config: RouterConfig, worker_urls: list[str], health: HealthConfig | None = None):
        self.config = config
        self.health = health or HealthConfig()
        # Engines given at start are trusted until a check fails; ones added later must pass one first.
        self.workers: dict[str, Worker] = {u: Worker(u) for u in map(check_url, worker_urls)}
        self._turn = itertools.count()  # round-robin among engines tied on outstanding requests
        self._sticky: OrderedDict[str, str] = OrderedDict()  # routing key -> worker url, LRU-bounded
        self.counters = _Counters()
        # Its async connections are made on the serving event loop, at the first request.
        self._client = EngineClient(timeout_s=config.request_timeout_s, connect_timeout_s=5.0)
        self.liveness = Liveness(self.health, self._client)
        # Fault injection (orchestration/faults.py): when it returns True an engine's reply is dropped.
        self.response_fault = None

    # ---- membership -------------------------------------------------------------------------

    def add(self, url: str) -> Worker:
        url = check_url(url)
        if url not in self.workers:
            # A new engine earns its place with a passing health check at the current weight version.
            self.workers[url] = Worker(url, quarantined=True)
        return self.workers[url]

    def remove(self, url: str) -> bool:
        url = url.rstrip("/")
        for key in [k for k, u in self._sticky.items() if u == url]:
            del self._sticky[key]
        return self.workers.pop(url, None) is not None

    def current_version(self) -> int | None:
        """The fleet's weight version: the newest any active engine reports."""
        versions = [w.weight_version for w in self.workers.values()
                    if not w.quarantined and w.weight_version is not None]
        return max(versions) if versions else None

    # ---- selection ----------------------------------------------------------------------------

    def pick(self, key: str | None, exclude: set[str]) -> Worker | None:
        active = [w for w in self.workers.values() if not w.quarantined and w.url not in exclude]
        if not active:
            return None
        if key is not None:
            url = self._sticky.get(key)
            if url is not None and url in self.workers and self.workers[url] in active:
                self._sticky.move_to_end(key)
                self.counters.sticky_hits += 1
                return self.workers[url]
        least = min(w.outstanding for w in active)
        tied = [w for w in active if w.outstanding == least]
        w = tied[next(self._turn) % len(tied)]
        if key is not None:
            self._sticky[key] = w.url
            self._sticky.move_to_end(key)
            while len(self._sticky) > _MAX_STICKY_KEYS:
                self._sticky.popitem(last=False)
        return w

    def record_failure(self, w: Worker, why: str) -> None:
        w.failures += 1
        w.last_error = why
        self.counters.failures += 1
        if not w.quarantined and self.health.dead(w.failures):
            w.quarantined = True
            self.counters.quarantines += 1
            log.warning("router: quarantined %s after %d failures (%s)", w.url, w.failures, why)

    def record_health(self, w: Worker, weight_version: int | None) -> None:
        w.failures = 0
        w.last_error = None
        w.weight_version = weight_version
        if w.quarantined:
            current = self.current_version()
            if current is None or weight_version == current:
                w.quarantined = False
                self.counters.readmissions += 1
                log.warning("router: re-admitted %s at weight version %s", w.url, weight_version)

    # ---- I/O ----------------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the connections to the engines (the serving event loop is ending)."""
        await self._client.aclose()

    def client(self) -> EngineClient:
        return self._client

    def _attempts(self, key: str | None, tried: set[str]):
        """The engines one request is tried on, in order: each pick skips those in `tried` (the caller
        adds an engine that could not be reached), at most max_retries + 1 of them."""
        self.counters.requests += 1
        for attempt in range(self.config.max_retries + 1):
            w = self.pick(key, tried)
            if w is None:
                return
            if attempt:
                self.counters.retries += 1
            yield w

    def _unavailable(self, errors: list[str]) -> bytes:
        self.counters.unavailable += 1
        why = "; ".join(errors) or "every engine is quarantined"
        return _json({"error": f"no engine could serve the request ({why}); check /list_workers"})

    async def proxy(self, method: str, path: str, body: bytes, content_type: str | None, key: str | None):
        """Returns (status, body bytes, content type) from the engine that served it."""
        tried: set[str] = set()
        errors = []
        for w in self._attempts(key, tried):
            w.outstanding += 1
            try:
                status, content, ctype = await self.client().asend(
                    method, w.url, path, body, {"content-type": content_type or "application/json"})
            except EngineError as exc:
                if exc.timed_out:
                    return 504, _json({"error": f"engine {w.url} did not answer within "
                                       f"{self.config.request_timeout_s}s"}), "application/json"
                # Nothing came back, so nothing was delivered: another engine can take it.
                self.record_failure(w, str(exc))
                tried.add(w.url)
                errors.append(str(exc))
                continue
            finally:
                w.outstanding -= 1
            w.served += 1
            if self.response_fault is not None and self.response_fault():
                return 502, _json({"error": f"the reply of {w.url} was dropped (fault injection)"}), \
                    "application/json"
            return status, content, ctype
        return 503, self._unavailable(errors), "application/json"

    @asynccontextmanager
    async def proxy_stream(self, path: str, body: bytes, content_type: str | None, key: str | None):
        """As proxy, for an answer the engine streams: yields (status, content type, async iterator of the
        body's pieces). Only a failure before the engine answered is retried on another engine."""
        tried: set[str] = set()
        errors = []
        for w in self._attempts(key, tried):
            w.outstanding += 1
            answered = False
            try:
                async with self.client().astream(w.url, path, body,
                                                 {"content-type": content_type or "application/json"}) as answer:
                    answered = True
                    w.served += 1
                    yield answer
                    return
            except EngineError as exc:
                if answered:
                    raise
                if exc.timed_out:
                    yield 504, "application/json", _pieces(_json({"error": f"engine {w.url} did not answer within "
                                                                            f"{self.config.request_timeout_s}s"}))
                    return
                self.record_failure(w, str(exc))
                tried.add(w.url)
                errors.append(str(exc))
                continue
            finally:
                w.outstanding -= 1
        yield 503, "application/json", _pieces(self._unavailable(errors))

    async def broadcast(self, path: str, body: bytes, authorized: bool) -> list[dict]:
        """POST `body` to every engine; with the router's admin token only when the caller was authorized."""
        headers = {"content-type": "application/json",
                   **(bearer_headers(self.config.admin_token) if authorized else {})}

        async def one(w: Worker) -> dict:
            try:
                status, _, _ = await self.client().asend("POST", w.url, path, body, headers)
                return {"url": w.url, "status": status}
            except Exception as exc:  # noqa: BLE001 - report per engine, do not fail the others
                return {"url": w.url, "status": None, "error": f"{type(exc).__name__}: {exc}"}

        return list(await asyncio.gather(*(one(w) for w in list(self.workers.values()))))

    async def check(self, w: Worker) -> None:
        why, version = await self.liveness.serving(w.url)
        if why is not None:
            self.record_failure(w, why)
        else:
            self.record_health(w, version)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    async def health_loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("router health check round failed")
            await asyncio.sleep(self.health.interval_s)

    def prometheus_text(self) -> str:
        c = self.counters
        lines = []
        for name, kind, value in [("requests_total", "counter", c.requests), ("retries_total", "counter", c.retries),
                                  ("failures_total", "counter", c.failures),
                                  ("quarantines_total", "counter", c.quarantines),
                                  ("readmissions_total", "counter", c.readmissions),
                                  ("unavailable_total", "counter", c.unavailable),
                                  ("sticky_hits_total", "counter", c.sticky_hits)]:
            lines += [f"# TYPE miles_router_{name} {kind}", f"miles_router_{name} {value}"]
        lines.append("# TYPE miles_router_worker_outstanding gauge")
        lines += [f'miles_router_worker_outstanding{{url="{w.url}"}} {w.outstanding}' for w in self.workers.values()]
        lines.append("# TYPE miles_router_worker_quarantined gauge")
        lines += [f'miles_router_worker_quarantined{{url="{w.url}"}} {int(w.quarantined)}'
                  for w in self.workers.values()]
        return "\n".join(lines) + "\n"


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


async def _pieces(*chunks: bytes):
    for c in chunks:
        yield c
