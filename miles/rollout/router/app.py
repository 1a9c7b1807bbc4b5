"""The router as a server: the HTTP app in front of a `Router`, run on a thread of this process
(`start_router_thread`, as `miles train` does), in a child process (`RouterProcess`), or in the
foreground (`miles router`, `python -m miles.rollout.router`).

The app speaks the engines' SGLang HTTP API: /generate and /v1/* go to one engine chosen by the
policy; /abort_request and /flush_cache go to every engine; /add_worker and /remove_worker change
the set at run time (as in sglang-router). Admin calls (membership, /flush_cache, aborting every
request) need the admin token when one is set, and only an authorized call is forwarded with the
router's own token; a router without one serves on loopback only unless given `--insecure-admin`.
An engine's refusal (4xx) comes back as that refusal, from one engine or from all of them. A streamed
request (`stream: true` on /generate or /v1/chat/completions) is answered piece by piece as the
engine streams.
Non-goals: the routing decisions themselves (policy.py).

    miles router --port 30000 --worker-urls http://HOST:30001 http://HOST:30002
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations, and
# `Request` is imported inside build_app so that loading a run config never imports FastAPI.
import asyncio
import json
import logging
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from miles.config import ConfigError
from miles.config.flags import load_server_config
from miles.net import (UNAUTHORIZED, BodyLimit, ServerProcess, ServerThread, bearer_ok, bind, exit_with_parent,
                       serve_app, url_of)
from miles.rollout.liveness import HealthConfig
from miles.rollout.router.config import RouterConfig, check_url
from miles.rollout.router.policy import Router
from miles.versions import to_wire

log = logging.getLogger(__name__)


def _streamed(body: bytes) -> bool:
    """Whether a request body asks for a streamed answer (a JSON object with "stream": true)."""
    if b'"stream"' not in body:
        return False
    try:
        parsed = json.loads(body)
    except ValueError:
        return False  # the engine refuses it, unstreamed
    return isinstance(parsed, dict) and parsed.get("stream") is True


def build_app(router: Router):
    """The FastAPI app serving `router`; its lifespan runs the liveness checks."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    from miles.engine_api import bodies, parsing  # pydantic: only once a router is built
    from miles.engine_api.errors import InvalidRequest

    @asynccontextmanager
    async def lifespan(_app):
        await router.check_all()
        task = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await router.close()

    app = FastAPI(title="miles router", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=int(router.config.max_request_mb * (1 << 20)))

    def admin(request: Request) -> JSONResponse | None:
        if not bearer_ok(request.headers.get("authorization"), router.config.admin_token):
            return JSONResponse({"error": UNAUTHORIZED}, status_code=401)
        return None

    async def forward(request: Request, path: str):
        key = request.headers.get(router.config.routing_key_header)
        body = await request.body()
        if request.method == "POST" and _streamed(body):
            return await relay(router.proxy_stream(path, body, request.headers.get("content-type"), key))
        status, body, ctype = await router.proxy(request.method, path, body,
                                                 request.headers.get("content-type"), key)
        return Response(content=body, status_code=status, media_type=ctype)

    async def relay(answer):
        """The engine's streamed answer, handed on piece by piece; the engine's connection stays open
        until the last piece went out (or the client left)."""
        status, ctype, pieces = await answer.__aenter__()

        async def out():
            try:
                async for piece in pieces:
                    yield piece
            finally:
                await answer.__aexit__(None, None, None)

        return StreamingResponse(out(), status_code=status, media_type=ctype)

    @app.post("/generate", openapi_extra=bodies.openapi_body(bodies.GenerateBody))
    async def generate(request: Request):
        return await forward(request, "/generate")

    async def openai(request: Request, rest: str):
        return await forward(request, "/v1/" + rest)

    for method in ("GET", "POST"):  # one route per method, so each has its own OpenAPI operation id
        app.add_api_route("/v1/{rest:path}", openai, methods=[method], name=f"openai_{method.lower()}")

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
        version = router.current_version()
        return {"weight_version": None if version is None else to_wire(version)}

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

    def broadcast_answer(results: list[dict]) -> JSONResponse:
        # Every engine refused (4xx): the request was bad, and the client hears so as the engines said.
        # Any engine unreachable or failing (5xx) is the router's gateway error.
        statuses = [r["status"] for r in results]
        ok = all(s == 200 for s in statuses)
        refused = [s for s in statuses if s is not None and 400 <= s < 500]
        status = 200 if ok else refused[0] if refused and len(refused) == len(statuses) else 502
        return JSONResponse({"success": ok, "workers": results}, status_code=status)

    @app.post("/abort_request", openapi_extra=bodies.openapi_body(bodies.Abort))
    async def abort_request(request: Request):
        body = await request.body()
        try:
            req = bodies.parse_body(bodies.Abort, parsing.parse_json(body) if body.strip() else {})
        except InvalidRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        # A client may abort its own request by id; aborting everyone's is an admin call, and only an
        # authorized caller's abort goes out with the router's token.
        if req.abort_all and (denied := admin(request)) is not None:
            return denied
        return broadcast_answer(await router.broadcast("/abort_request", body, authorized=req.abort_all))

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        if (denied := admin(request)) is not None:
            return denied
        return broadcast_answer(await router.broadcast("/flush_cache", await request.body(), authorized=True))

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(router.prometheus_text(), media_type="text/plain; version=0.0.4")

    return app


@dataclass
class RunningRouter:
    """A built-in router served on a daemon thread of this process."""

    url: str
    router: Router
    http: ServerThread

    def stop(self) -> None:
        self.http.stop()


def start_router_thread(config: RouterConfig, worker_urls: list[str], health: HealthConfig | None = None,
                        startup_timeout_s: float = 30.0) -> RunningRouter:
    """Serve a built-in router on a daemon thread of this process; returns once it answers."""
    config.check_admin_exposure()
    router = Router(config, worker_urls, health)
    http = serve_app(build_app(router), bind(config.host, config.port), config.host, what="router",
                     ready_path="/list_workers", startup_timeout_s=startup_timeout_s, lifespan="on",
                     timeout_graceful_shutdown=5)
    return RunningRouter(http.url, router, http)


class RouterProcess(ServerProcess):
    """The built-in router in a child process (`python -m miles.rollout.router`); `.url`, `.stop()`."""

    def __init__(self, worker_urls: list[str], *, extra_args: list[str] | None = None,
                 startup_timeout_s: float = 60.0):
        cmd = [sys.executable, "-m", "miles.rollout.router", "--port", "0", "--worker-urls", *worker_urls,
               *(extra_args or [])]
        super().__init__(cmd, url_line=r"miles router serving .* at (http://\S+)", ready_path="/list_workers",
                         startup_timeout_s=startup_timeout_s, what="router process")


@dataclass
class RouterServeConfig:
    """What `miles router` reads from its flags."""

    router: RouterConfig = field(default_factory=RouterConfig)
    """The router itself (`--router.KEY`; `--host`, `--port`, `--admin-token` are short for its keys)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """When an engine is quarantined (`--health.KEY`)."""
    worker_urls: list[str] = field(default_factory=list)
    """Engine URLs, e.g. http://10.0.0.5:30001 (`--worker-urls A B`)."""
    log_level: str = "warning"
    """Python logging level of the router process."""

    def validate(self) -> None:
        try:
            for url in self.worker_urls:
                check_url(url)
        except ValueError as exc:
            raise ConfigError(f"worker_urls: {exc}") from None
        if self.router.own_process:
            raise ConfigError("router.own_process is a `miles train` setting (where the router runs); `miles "
                              "router` is a process of its own already: drop the flag")


# The flags `miles router` has always taken, as keys of RouterServeConfig.
_ALIASES = {**{k: f"router.{k}" for k in ("host", "port", "admin_token", "routing_key_header", "max_retries",
                                          "request_timeout_s", "kind")},
            "health_check_interval_s": "health.interval_s", "health_check_timeout_s": "health.timeout_s",
            "failure_threshold": "health.failure_threshold"}
_USAGE = """usage: miles router [--host H] [--port P] [--worker-urls URL ...] [--admin-token T | --insecure-admin]
                    [--KEY VALUE ...]

Serve the built-in miles router in front of engines that speak the SGLang HTTP API.
Every key of the router and health sections is a flag: --router.max_retries 3, --health.interval_s 0.5
(--port=P works too). --port defaults to 30000; 0 picks a free one and prints the URL.
Without --admin-token the router binds loopback only; --insecure-admin lets it bind another --host
with every admin route open (only on a trusted network)."""


def parse_args(argv=None) -> RouterServeConfig:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = load_server_config(RouterServeConfig, argv, prog="miles router", usage=_USAGE,
                             defaults={"router.port": "30000"}, aliases=_ALIASES, lists=("worker_urls",),
                             switches={"insecure_admin": ("router.insecure_admin", "true")})
    try:
        cfg.router.check_admin_exposure()
    except ConfigError as exc:
        print(f"miles router: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return cfg


def main(argv=None) -> int:
    import uvicorn

    cfg = parse_args(argv)
    config, urls = cfg.router, cfg.worker_urls
    logging.basicConfig(level=cfg.log_level.upper())
    # A RouterProcess (a child that a test or tool started) ends with the process that started it, even a
    # SIGKILLed one; a run's router (orchestration/router_supervisor.py) is started without that, to outlive it.
    exit_with_parent()
    sock = bind(config.host, config.port)
    print(f"miles router serving {len(urls)} engines at {url_of(sock, config.host)}", flush=True)
    router = Router(config, urls, cfg.health)
    server = uvicorn.Server(uvicorn.Config(build_app(router), log_level=cfg.log_level, lifespan="on"))
    if config.exit_without_engines_s:
        threading.Thread(target=_exit_without_engines, args=(router, server, config.exit_without_engines_s),
                         name="miles-router-idle-exit", daemon=True).start()
    server.run(sockets=[sock])
    return 0


def _exit_without_engines(router: Router, server, limit_s: float, check_every_s: float = 1.0) -> None:
    """Stop `server` once no engine of `router` has been serving for limit_s: a router left behind by a
    driver whose engines died with it would otherwise hold its port for good."""
    since = None
    while not server.should_exit:
        time.sleep(check_every_s)
        try:
            serving = any(not w.quarantined for w in list(router.workers.values()))
        except RuntimeError:  # the set changed while it was read (the serving thread); read it next time
            continue
        now = time.monotonic()
        if serving:
            since = None
        elif since is None:
            since = now
        elif now - since >= limit_s:
            log.warning("no engine has served for %.0fs (router.exit_without_engines_s): exiting", now - since)
            server.should_exit = True
