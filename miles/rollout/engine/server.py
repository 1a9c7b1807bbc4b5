"""HTTP front of the built-in engine, speaking SGLang's API (field names and response shapes).

Clients that drive SGLang servers (the router, generate functions, weight-sync transports) drive
this one unchanged. Every request body is checked in protocol.py before it reaches the engine; a bad
request gets HTTP 400 {"error": "<field>: <reason>"} and the engine keeps serving.
Admin endpoints (weight updates, cache flush) need `Authorization: Bearer <token>` when the engine
was started with an admin token.
Non-goals: streaming, OpenAI-compatible routes, multi-node engines.

    python -m miles.rollout.engine.server --model DIR --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from miles.rollout.engine import protocol
from miles.rollout.engine.config import EngineConfig
from miles.rollout.engine.types import MEMORY_TAGS, PAUSE_MODES, InvalidRequest
from miles.rollout.engine.weight_api import build_weight_router

log = logging.getLogger(__name__)


def build_app(engine) -> FastAPI:
    app = FastAPI(title="miles engine")

    @app.exception_handler(InvalidRequest)
    async def _invalid(_request, exc: InvalidRequest):
        return JSONResponse({"error": str(exc), "success": False, "message": str(exc)}, status_code=400)

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        log.exception("request failed")
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    def require_admin(request: Request) -> None:
        token = engine.config.admin_token
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise _Unauthorized()

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(_request, _exc):
        return JSONResponse({"error": "admin endpoint: send header 'Authorization: Bearer <admin token>'"},
                            status_code=401)

    async def body_of(request: Request) -> dict:
        return protocol.parse_json(await request.body())

    def model_info() -> dict:
        return {"model_path": engine.config.model_path, "tokenizer_path": engine.config.model_path,
                "is_generation": True, "weight_version": engine.weight_version}

    @app.post("/generate")
    async def generate(request: Request):
        items, batched = protocol.parse_generate(await body_of(request), engine.tokenizer,
                                                 engine.config.default_max_new_tokens)
        # Check the whole batch before queueing any of it, so a bad item rejects the call cleanly.
        reqs = [engine.make_request(it.input_ids, it.params, it.return_logprob, it.rid, it.return_routed_experts)
                for it in items]
        futures = [engine.submit(r) for r in reqs]
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:
            for r in reqs:  # the client went away: free the batch slots
                engine.abort(r.rid)
            raise
        out = [r.to_sglang() for r in results]
        return JSONResponse(out if batched else out[0])

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        from miles.rollout.engine.sampler import SamplingParams

        if engine.paused or engine.released:
            return JSONResponse({"error": "generation is paused or memory is released; call "
                                 "/continue_generation or /resume_memory_occupation"}, status_code=503)
        req = engine.make_request([engine.pad_token_id], SamplingParams(temperature=0.0, max_new_tokens=1))
        try:
            await asyncio.wait_for(asyncio.wrap_future(engine.submit(req)), timeout=60)
        except Exception as exc:  # noqa: BLE001
            engine.abort(req.rid)
            return JSONResponse({"error": f"generation failed: {exc!r}"}, status_code=503)
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def get_model_info():
        return model_info()

    @app.get("/get_server_info")
    async def get_server_info():
        running, waiting = engine.num_requests()
        return {**engine.config.public_dict(), **model_info(), "context_length": engine.context_length,
                "vocab_size": engine.vocab_size, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "engine_stats": dict(engine.stats)}

    @app.get("/get_load")
    async def get_load():
        running, waiting = engine.num_requests()
        return {"num_reqs": running + waiting, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "paused": engine.paused, "released": list(engine.released)}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await body_of(request)
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise InvalidRequest("abort_all: expected true or false")
        if abort_all:
            require_admin(request)  # a client may abort its own request, only an admin everyone's
        elif not isinstance(rid, str):
            raise InvalidRequest("rid: send the request id to abort, or abort_all=true")
        engine.abort(None if abort_all else rid)
        return {"success": True}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        require_admin(request)
        body = await body_of(request)
        protocol.no_unknown(body, {"mode"})
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode: {mode!r} is not a pause mode; use one of {list(PAUSE_MODES)}")
        await asyncio.to_thread(engine.pause, mode)
        return {"success": True, "message": f"generation paused ({mode})"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        require_admin(request)
        engine.continue_generation()
        return {"success": True, "message": "generation continued"}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        require_admin(request)
        tags = protocol.parse_memory_tags(await body_of(request), MEMORY_TAGS)
        await asyncio.to_thread(engine.release_memory, tags)
        return {"success": True, "message": f"released {list(tags)}"}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        require_admin(request)
        tags = protocol.parse_memory_tags(await body_of(request), MEMORY_TAGS)
        await asyncio.to_thread(engine.resume_memory, tags)
        return {"success": True, "message": f"resumed {list(tags)}"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        require_admin(request)
        engine.flush_cache()
        return {"success": True, "message": "cache flushed"}

    # Weight routes: the shared ones and each registered transport's (miles/sync/transports/<name>.py).
    app.include_router(build_weight_router(engine, require_admin))
    return app


class _Unauthorized(Exception):
    pass


def prometheus_text(engine) -> str:
    """Prometheus exposition of the engine's counters and gauges (stable `miles_engine_` names)."""
    st = dict(engine.stats)
    running, waiting = engine.num_requests()
    hit = st["cached_tokens"] / st["prompt_tokens"] if st["prompt_tokens"] else 0.0
    rows = [
        ("prompt_tokens_total", "counter", "Prompt tokens admitted", st["prompt_tokens"]),
        ("cached_tokens_total", "counter", "Prompt tokens whose KV came from the prefix cache", st["cached_tokens"]),
        ("prefix_cache_hit_rate", "gauge", "cached_tokens_total / prompt_tokens_total", hit),
        ("prefix_cache_tokens", "gauge", "Tokens held by the prefix cache", engine.prefix_cache.num_tokens),
        ("generated_tokens_total", "counter", "Completion tokens generated", st["generated_tokens"]),
        ("prefill_forwards_total", "counter", "Prefill forwards", st["prefill_forwards"]),
        ("decode_forwards_total", "counter", "Decode forwards", st["decode_forwards"]),
        ("retracted_requests_total", "counter", "Requests retracted by pause or memory release",
         st["retracted_reqs"]),
        ("num_running_reqs", "gauge", "Requests in the running batch", running),
        ("num_waiting_reqs", "gauge", "Requests waiting for a batch slot", waiting),
        ("weight_version", "gauge", "Weight version in force", engine.weight_version),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP miles_engine_{name} {help_}", f"# TYPE miles_engine_{name} {kind}",
                f"miles_engine_{name} {value}"]
    return "\n".join(out) + "\n"


@dataclass
class RunningServer:
    """An engine served by uvicorn on a daemon thread of this process."""

    url: str
    engine: object
    _server: object
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.engine.stop()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _url(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(engine, log_level: str = "warning"):
    import uvicorn

    # Keep-alive outlives the clients' idle-connection expiry (httpx: 5 s): with equal timeouts a client
    # can reuse a connection in the instant the server closes it and get no response at all.
    return uvicorn.Server(uvicorn.Config(build_app(engine), log_level=log_level, lifespan="off",
                                         timeout_graceful_shutdown=5, timeout_keep_alive=65))


def start_server_thread(config: EngineConfig, startup_timeout_s: float = 60.0) -> RunningServer:
    """Load the engine, serve it on a daemon thread, and return once /health answers."""
    import httpx

    from miles.rollout.engine.engine import Engine

    engine = Engine(config)
    sock = _bind(config.host, config.port)
    server = _uvicorn_server(engine)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="miles-engine-http",
                              daemon=True)
    thread.start()
    url = _url(sock, config.host)
    deadline = time.monotonic() + startup_timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return RunningServer(url, engine, server, thread)
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            engine.stop()
            raise RuntimeError(f"engine server at {url} did not answer /health within {startup_timeout_s}s")
        time.sleep(0.05)


def parse_args(argv=None) -> tuple[EngineConfig, str]:
    p = argparse.ArgumentParser(prog="miles serve", description="Serve a model with the built-in miles engine "
                                "(SGLang-compatible HTTP API).")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory or hub id")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one and prints the URL")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--admin-token", default=None, help="require this bearer token on admin endpoints")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads for this engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--default-max-new-tokens", type=int, default=128)
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse KV across requests")
    p.add_argument("--prefix-block-size", type=int, default=8, help="tokens per prefix-cache block")
    p.add_argument("--prefix-cache-mb", type=float, default=512.0, help="memory the prefix cache may hold")
    p.add_argument("--offload-dir", default=None, help="where released weights are parked")
    p.add_argument("--no-reuse-weight-memory", action="store_true",
                   help="free the memory a weight update displaces instead of receiving the next one into it")
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    cfg = EngineConfig(model_path=a.model, host=a.host, port=a.port, dtype=a.dtype, admin_token=a.admin_token,
                       max_batch_size=a.max_batch_size, context_length=a.context_length,
                       num_threads=a.num_threads, seed=a.seed, default_max_new_tokens=a.default_max_new_tokens,
                       prefix_cache=not a.no_prefix_cache, prefix_block_size=a.prefix_block_size,
                       prefix_cache_mb=a.prefix_cache_mb, offload_dir=a.offload_dir,
                       reuse_weight_memory=not a.no_reuse_weight_memory)
    from miles.config import ConfigError

    try:
        cfg.validate()
    except ConfigError as e:
        p.error(str(e))
    return cfg, a.log_level


def main(argv=None) -> int:
    """Serve in the foreground until SIGINT/SIGTERM."""
    config, log_level = parse_args(argv)  # before the heavy import: --help answers at once
    from miles.rollout.engine.engine import Engine

    logging.basicConfig(level=log_level.upper())
    engine = Engine(config)
    sock = _bind(config.host, config.port)
    server = _uvicorn_server(engine, log_level)
    # Parents that started us with --port 0 read the URL from this line.
    print(f"miles engine serving {config.model_path} at {_url(sock, config.host)}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
