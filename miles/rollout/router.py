"""Router: one URL in front of many engines, speaking the same SGLang HTTP API they do.

Selection is least-outstanding-requests: each request goes to the active engine with the fewest
requests this router has in flight there (ties are broken round-robin). A
request that carries a routing key (header `X-Routing-Key` by default) sticks to the engine that
served that key before, so a multi-turn episode returns to the engine holding its prefix KV; if that
engine is quarantined the key moves.

Proxying is transparent: the request body goes out byte for byte and the engine's response (status,
body) comes back byte for byte, so every field survives (logprobs, weight versions, routed experts).

Health: every `health_check_interval_s` each engine's /health and /get_weight_version are read. After
`failure_threshold` consecutive failures (health checks or requests that failed before an answer) an
engine is quarantined: it gets no new requests. It is re-admitted once healthy again AND at the fleet's
current weight version, so an engine that restarted from an old checkpoint cannot serve stale
weights. A request whose engine fails before answering (connection refused or reset) is retried on
another engine; a timeout is not retried, because the first engine may still be generating.
Engines are added and removed at run time (/add_worker, /remove_worker, as in sglang-router).

`router.kind = "sglang"` launches the Rust `sglang-router` instead (`launch_sglang_router`); it
does not forward fields it does not know, so `check_features` refuses it where a feature needs one.
Non-goals: prefill/decode disaggregation, cache-aware (radix) routing, streaming.

    miles router --port 30000 --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import itertools
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

log = logging.getLogger(__name__)

ROUTER_KINDS = ("miles", "sglang")
# Paths that act on every engine at once rather than on one chosen engine.
_BROADCAST_PATHS = ("/abort_request", "/flush_cache")
_MAX_STICKY_KEYS = 100_000


@dataclass
class RouterConfig:
    kind: str = "miles"
    """Which router fronts the engines: "miles" (built in) or "sglang" (the Rust sglang-router package)."""
    host: str = "127.0.0.1"
    """Interface the router binds to; loopback unless clients on other hosts must reach it."""
    port: int = 0
    """HTTP port; 0 picks a free one."""
    routing_key_header: str = "X-Routing-Key"
    """Requests carrying this header stick to the engine that served the same key before."""
    health_check_interval_s: float = 2.0
    """Seconds between two health checks of every engine."""
    health_check_timeout_s: float = 5.0
    """A health check slower than this counts as a failure."""
    failure_threshold: int = 3
    """Consecutive failures (health checks or requests) after which an engine is quarantined."""
    max_retries: int = 2
    """Other engines a request is retried on when its engine fails before answering."""
    request_timeout_s: float = 600.0
    """Longest a proxied request may take; a timed-out request is answered 504 and not retried."""
    admin_token: str | None = None
    """When set, /add_worker, /remove_worker and broadcasts need `Authorization: Bearer <token>`;
    it is also sent to the engines on broadcasts."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.kind not in ROUTER_KINDS:
            raise ConfigError(f"router.kind: {self.kind!r} is not a router; use one of {list(ROUTER_KINDS)}")
        if self.failure_threshold < 1:
            raise ConfigError("router.failure_threshold must be >= 1")
        if self.max_retries < 0:
            raise ConfigError("router.max_retries must be >= 0")
        if self.health_check_interval_s <= 0 or self.health_check_timeout_s <= 0:
            raise ConfigError("router.health_check_interval_s and health_check_timeout_s must be > 0")

    def check_features(self, *, return_routed_experts: bool = False) -> None:
        """Refuse a router that would silently drop what a feature of this run needs."""
        from miles.config import ConfigError

        if self.kind == "sglang" and return_routed_experts:
            raise ConfigError(
                "router.kind = 'sglang' drops routed experts from /generate responses, which routing "
                "replay (R3) needs: set router.kind = 'miles' or turn off return_routed_experts")


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


class _Unreachable(Exception):
    """The engine could not be reached or dropped the connection before answering."""


class _TimedOut(Exception):
    """The engine took longer than the request timeout."""


class _Upstream:
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
                raise _TimedOut() from None
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                # Most often a pooled keep-alive connection the server had just closed: one more try
                # on a fresh connection. A dead engine then refuses the connection outright.
                if attempt:
                    raise _Unreachable(f"{type(exc).__name__}: {exc}") from None
            except aiohttp.ClientError as exc:
                raise _Unreachable(f"{type(exc).__name__}: {exc}") from None

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
            raise _TimedOut() from None
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise _Unreachable(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        if self._session is not None:
            await (self._session.close() if self._aiohttp is not None else self._session.aclose())
            self._session = None


class Router:
    """The routing state and its policies; `build_app` puts HTTP in front of it."""

    def __init__(self, config: RouterConfig, worker_urls: list[str]):
        self.config = config
        # Engines given at start are trusted until a check fails; ones added later must pass one first.
        self.workers: dict[str, Worker] = {u: Worker(u) for u in map(_check_url, worker_urls)}
        self._turn = itertools.count()  # round-robin among engines tied on outstanding requests
        self._sticky: OrderedDict[str, str] = OrderedDict()  # routing key -> worker url, LRU-bounded
        self.counters = _Counters()
        self._client = None  # httpx.AsyncClient, created on the serving event loop
        # Fault injection (orchestration/faults.py): when it returns True an engine's reply is dropped.
        self.response_fault = None

    # ---- membership -------------------------------------------------------------------------

    def add(self, url: str) -> Worker:
        url = _check_url(url)
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
        if not w.quarantined and w.failures >= self.config.failure_threshold:
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

    def client(self) -> "_Upstream":
        if self._client is None:
            self._client = _Upstream(self.config.request_timeout_s)
        return self._client

    async def proxy(self, method: str, path: str, body: bytes, content_type: str | None, key: str | None):
        """Returns (status, body bytes, content type) from the engine that served it."""
        self.counters.requests += 1
        tried: set[str] = set()
        errors = []
        for attempt in range(self.config.max_retries + 1):
            w = self.pick(key, tried)
            if w is None:
                break
            if attempt:
                self.counters.retries += 1
            w.outstanding += 1
            try:
                status, content, ctype = await self.client().request(
                    method, w.url + path, body, {"content-type": content_type or "application/json"})
            except _Unreachable as exc:
                # Nothing came back, so nothing was delivered: another engine can take it.
                self.record_failure(w, str(exc))
                tried.add(w.url)
                errors.append(f"{w.url}: {exc}")
                continue
            except _TimedOut:
                return 504, _json({"error": f"engine {w.url} did not answer within "
                                   f"{self.config.request_timeout_s}s"}), "application/json"
            finally:
                w.outstanding -= 1
            w.served += 1
            if self.response_fault is not None and self.response_fault():
                return 502, _json({"error": f"the reply of {w.url} was dropped (fault injection)"}), \
                    "application/json"
            return status, content, ctype
        self.counters.unavailable += 1
        why = "; ".join(errors) or "every engine is quarantined"
        return 503, _json({"error": f"no engine could serve the request ({why}); check /list_workers"}), \
            "application/json"

    async def broadcast(self, path: str, body: bytes) -> list[dict]:
        headers = {"content-type": "application/json"}
        if self.config.admin_token:
            headers["authorization"] = f"Bearer {self.config.admin_token}"

        async def one(w: Worker) -> dict:
            try:
                status, _, _ = await self.client().request("POST", w.url + path, body, headers)
                return {"url": w.url, "status": status}
            except Exception as exc:  # noqa: BLE001 - report per engine, do not fail the others
                return {"url": w.url, "status": None, "error": f"{type(exc).__name__}: {exc}"}

        return list(await asyncio.gather(*(one(w) for w in list(self.workers.values()))))

    async def check(self, w: Worker) -> None:
        timeout = self.config.health_check_timeout_s
        try:
            status, _, _ = await self.client().request("GET", w.url + "/health", timeout=timeout)
            if status != 200:
                raise RuntimeError(f"/health answered {status}")
            status, content, _ = await self.client().request("GET", w.url + "/get_weight_version", timeout=timeout)
            version = json.loads(content).get("weight_version") if status == 200 else None
            if isinstance(version, str) and version.isdigit():  # SGLang reports versions as strings
                version = int(version)
        except Exception as exc:  # noqa: BLE001 - any failure is a failed check
            self.record_failure(w, f"health check: {type(exc).__name__}: {exc}")
            return
        self.record_health(w, version)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    async def health_loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("router health check round failed")
            await asyncio.sleep(self.config.health_check_interval_s)

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


def build_app(router: Router):
    @asynccontextmanager
    async def lifespan(_app):
        await router.check_all()
        task = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            task.cancel()
            if router._client is not None:
                await router._client.close()
                router._client = None

    app = FastAPI(title="miles router", lifespan=lifespan)

    def admin(request: Request) -> JSONResponse | None:
        token = router.config.admin_token
        given = request.headers.get("authorization", "")
        if token is not None and not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return JSONResponse({"error": "admin endpoint: send header 'Authorization: Bearer <admin token>'"},
                                status_code=401)
        return None

    async def forward(request: Request, path: str):
        key = request.headers.get(router.config.routing_key_header)
        status, body, ctype = await router.proxy(request.method, path, await request.body(),
                                                 request.headers.get("content-type"), key)
        return Response(content=body, status_code=status, media_type=ctype)

    @app.post("/generate")
    async def generate(request: Request):
        return await forward(request, "/generate")

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST"])
    async def openai(request: Request, rest: str):
        return await forward(request, "/v1/" + rest)

    @app.get("/health")
    async def health():
        active = sum(not w.quarantined for w in router.workers.values())
        if not active:
            return JSONResponse({"status": "no active engine", "workers": len(router.workers)}, status_code=503)
        return {"status": "ok", "active_workers": active}

    for path in ("/health_generate", "/get_model_info", "/get_server_info"):
        async def one_engine(request: Request, path=path):
            return await forward(request, path)
        app.add_api_route(path, one_engine, methods=["GET"])

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": router.current_version()}

    @app.get("/get_load")
    async def get_load():
        return {"workers": [w.public() for w in router.workers.values()]}

    @app.get("/list_workers")
    async def list_workers():
        return {"urls": list(router.workers), "workers": [w.public() for w in router.workers.values()]}

    @app.post("/add_worker")
    async def add_worker(request: Request, url: str):
        if (denied := admin(request)) is not None:
            return denied
        try:
            w = router.add(url)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        await router.check(w)
        return {"success": True, "worker": w.public()}

    @app.post("/remove_worker")
    async def remove_worker(request: Request, url: str):
        if (denied := admin(request)) is not None:
            return denied
        if not router.remove(url):
            return JSONResponse({"error": f"url: {url!r} is not a worker; see /list_workers"}, status_code=404)
        return {"success": True}

    for path in _BROADCAST_PATHS:
        async def to_all(request: Request, path=path):
            body = await request.body()
            if path == "/flush_cache" and (denied := admin(request)) is not None:
                return denied
            results = await router.broadcast(path, body)
            ok = all(r["status"] == 200 for r in results)
            return JSONResponse({"success": ok, "workers": results}, status_code=200 if ok else 502)
        app.add_api_route(path, to_all, methods=["POST"])

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(router.prometheus_text(), media_type="text/plain; version=0.0.4")

    return app


@dataclass
class RunningRouter:
    """A built-in router served by uvicorn on a daemon thread of this process."""

    url: str
    router: Router
    _server: object
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def start_router_thread(config: RouterConfig, worker_urls: list[str], startup_timeout_s: float = 30.0):
    import httpx
    import uvicorn

    router = Router(config, worker_urls)
    sock = _bind(config.host, config.port)
    server = uvicorn.Server(uvicorn.Config(build_app(router), log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="miles-router", daemon=True)
    thread.start()
    url = _url(sock, config.host)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline and thread.is_alive():
        try:
            httpx.get(url + "/list_workers", timeout=2)
            return RunningRouter(url, router, server, thread)
        except httpx.TransportError:
            time.sleep(0.05)
    server.should_exit = True
    raise RuntimeError(f"router at {url} did not start within {startup_timeout_s}s")


class RouterProcess:
    """The built-in router in a child process (`python -m miles.rollout.router`); `.url`, `.stop()`."""

    def __init__(self, worker_urls: list[str], *, extra_args: list[str] | None = None,
                 startup_timeout_s: float = 60.0):
        import re

        import httpx

        cmd = [sys.executable, "-m", "miles.rollout.router", "--port", "0", "--worker-urls", *worker_urls,
               *(extra_args or [])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self.url: str | None = None
        found = threading.Event()

        def drain() -> None:
            for line in self.proc.stdout:
                self.output.append(line)
                m = re.search(r"miles router serving .* at (http://\S+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    found.set()

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if found.wait(0.1):
                try:
                    httpx.get(self.url + "/list_workers", timeout=2)
                    return
                except httpx.TransportError:
                    pass
        self.stop()
        raise RuntimeError(f"router process did not start within {startup_timeout_s}s; its output:\n"
                           f"{''.join(self.output[-50:])}")

    def stop(self, timeout_s: float = 15.0) -> None:
        from miles.rollout.engine.process import terminate

        terminate(self.proc, timeout_s)

    def __enter__(self) -> "RouterProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_sglang_router(config: RouterConfig, worker_urls: list[str], port: int,
                         extra_args: list[str] | None = None) -> subprocess.Popen:
    """Start the Rust sglang-router (a test dependency, `pip install sglang-router`) on `port`."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise RuntimeError("router.kind = 'sglang' needs the sglang-router package: pip install sglang-router, "
                           "or set router.kind = 'miles'") from None
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", config.host, "--port", str(port),
           "--policy", "power_of_two" if len(worker_urls) > 1 else "round_robin",
           "--health-failure-threshold", str(config.failure_threshold),
           "--health-check-interval-secs", str(max(1, int(config.health_check_interval_s))),
           "--request-timeout-secs", str(int(config.request_timeout_s)),
           "--worker-urls", *worker_urls, *(extra_args or [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _url(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _check_url(url: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url: {url!r} is not an engine URL; send http://host:port")
    return url.rstrip("/")


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def parse_args(argv=None) -> tuple[RouterConfig, list[str], str]:
    p = argparse.ArgumentParser(prog="miles router", description="Serve the built-in miles router in front of "
                                "engines that speak the SGLang HTTP API.")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    p.add_argument("--port", type=int, default=30000, help="port; 0 picks a free one and prints the URL")
    p.add_argument("--worker-urls", nargs="*", default=[], help="engine URLs, e.g. http://127.0.0.1:30001")
    p.add_argument("--routing-key-header", default="X-Routing-Key")
    p.add_argument("--health-check-interval-s", type=float, default=2.0)
    p.add_argument("--health-check-timeout-s", type=float, default=5.0)
    p.add_argument("--failure-threshold", type=int, default=3)
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--admin-token", default=None)
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    cfg = RouterConfig(host=a.host, port=a.port, routing_key_header=a.routing_key_header,
                       health_check_interval_s=a.health_check_interval_s,
                       health_check_timeout_s=a.health_check_timeout_s, failure_threshold=a.failure_threshold,
                       max_retries=a.max_retries, request_timeout_s=a.request_timeout_s, admin_token=a.admin_token)
    from miles.config import ConfigError

    try:
        cfg.validate()
        urls = [_check_url(u) for u in a.worker_urls]
    except (ConfigError, ValueError) as exc:
        p.error(str(exc))
    return cfg, urls, a.log_level


def main(argv=None) -> int:
    import uvicorn

    config, urls, log_level = parse_args(argv)
    logging.basicConfig(level=log_level.upper())
    sock = _bind(config.host, config.port)
    print(f"miles router serving {len(urls)} engines at {_url(sock, config.host)}", flush=True)
    server = uvicorn.Server(uvicorn.Config(build_app(Router(config, urls)), log_level=log_level, lifespan="on"))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
