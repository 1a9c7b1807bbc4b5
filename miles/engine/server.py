"""HTTP front of the built-in engine, speaking SGLang's API (field names and response shapes).

Clients that drive SGLang servers (the router, generate functions, weight-sync transports) drive
this one unchanged. Every request body is checked (engine_api/parsing.py, bodies.py) before it
reaches the engine; a bad request gets HTTP 400 {"error": "<field>: <reason>"} and the engine keeps
serving. A request that passes the checks and still makes the engine's step raise gets 422, and the
requests batched with it go on (503, retry, where no single request can be blamed; scheduler.py).
Admin endpoints (weight updates, cache flush, pausing, aborting every request) need
`Authorization: Bearer <token>` when the engine was started with an admin token; an engine without
one serves on loopback only, unless started with `--insecure-admin`. Bodies are bounded in size
(413), parsed and tokenized off the event loop, and published in the OpenAPI schema (/openapi.json).
What miles needs beyond SGLang's protocol is an extension, listed in /get_server_info as
`miles_extensions`; with `sglang_only` (`miles serve --sglang-only true`) there are none and only
SGLang's routes and fields are served, which is how miles is tested against SGLang's protocol.
LoRA adapters are loaded and unloaded with SGLang's /load_lora_adapter and /unload_lora_adapter
(admin routes; what a request without `lora_path` uses is in lora.py).
SGLang's OpenAI-compatible /v1/models and /v1/chat/completions are openai_routes.py's.
`stream: true` on /generate sends each step's tokens as they are sampled (SSE chunks, streaming.py).
Non-goals: streaming a batched /generate, multi-node engines.

    python -m miles.engine.server --model DIR --port 30000
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from miles.config import ConfigError
from miles.config.flags import load_server_config
from miles.devices import gpu_uuid
from miles.engine_api import bodies, parsing
from miles.engine_api.errors import EngineStepFailed, InvalidRequest, RequestFailed
from miles.engine_api.extensions import SERVER_INFO_KEY
from miles.engine_api.sampling import SamplingParams
from miles.engine_api.types import MEMORY_TAGS
from miles.net import UNAUTHORIZED, BodyLimit, ServerThread, bearer_ok, bind, exit_with_parent, serve_app, url_of
from miles.engine.config import EngineConfig
from miles.engine.openai_routes import add_openai_routes
from miles.engine.streaming import TokenDelta, stream
from miles.engine.weight_api import WeightRoutes

log = logging.getLogger(__name__)

LARGE_BODY = 1 << 20  # bytes: a /generate body past this is parsed on the one large-body thread


async def _generate_chunks(engine, req):
    """A streamed /generate as SGLang sends it by default (not incremental): every chunk holds the text,
    output ids and output logprobs so far, `finish_reason` null until the last, then `data: [DONE]`.
    A request that fails after its first chunk ends the stream with `{"error": ...}`."""
    ids: list[int] = []
    lps: list[float] = []
    try:
        async for item in stream(engine, req):
            if isinstance(item, TokenDelta):
                ids += item.ids
                lps += item.logprobs
                meta = {"id": req.rid, "prompt_tokens": len(req.input_ids), "completion_tokens": len(ids),
                        "finish_reason": None, "weight_version": engine.weight_version}
                if req.return_logprob:
                    meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
                p = req.params
                chunk = {"text": engine.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens),
                         "output_ids": list(ids), "meta_info": meta}
            else:
                chunk = item.to_sglang()
            yield f"data: {json.dumps(chunk)}\n\n"
    except (RequestFailed, EngineStepFailed) as exc:
        yield f"data: {json.dumps({'error': str(exc)})}\n\n"
    yield "data: [DONE]\n\n"


def build_app(engine) -> FastAPI:
    app = FastAPI(title="miles engine")
    app.add_middleware(BodyLimit, max_bytes=int(engine.config.max_request_mb * (1 << 20)))

    @app.exception_handler(InvalidRequest)
    async def _invalid(_request, exc: InvalidRequest):
        return JSONResponse({"error": str(exc), "success": False, "message": str(exc)}, status_code=400)

    # A step that raised on one request is that request's failure alone (scheduler.py, failure isolation).
    @app.exception_handler(RequestFailed)
    async def _failed(_request, exc: RequestFailed):
        return JSONResponse({"error": str(exc), "success": False, "message": str(exc)}, status_code=422)

    @app.exception_handler(EngineStepFailed)
    async def _step_failed(_request, exc: EngineStepFailed):
        return JSONResponse({"error": str(exc), "success": False, "message": str(exc)}, status_code=503,
                            headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        log.exception("request failed")
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    def require_admin(request: Request) -> None:
        if not bearer_ok(request.headers.get("authorization"), engine.config.admin_token):
            raise _Unauthorized()

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(_request, _exc):
        return JSONResponse({"error": UNAUTHORIZED}, status_code=401)

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        return parsing.parse_json(raw) if raw.strip() else {}  # SGLang's control routes take an empty body

    weights = WeightRoutes(engine, require_admin)
    miles_mode = not engine.config.sglang_only

    def model_info() -> dict:
        return {"model_path": engine.config.model_path, "tokenizer_path": engine.config.model_path,
                "served_model_name": engine.config.model_path, "is_generation": True,
                "weight_version": engine.weight_version}

    def checked_generate(raw: bytes) -> tuple[list, bool, bool]:
        body = parsing.parse_json(raw)
        items, batched = parsing.parse_generate(body, engine.tokenizer, engine.config.default_max_new_tokens,
                                                 engine.context_length)
        # Check the whole batch before queueing any of it, so a bad item rejects the call cleanly.
        return [engine.make_request(it.input_ids, it.params, it.return_logprob, it.rid, it.return_routed_experts,
                                    it.lora_path, it.logprob_start_len, it.image_data) for it in items], batched, \
            body.get("stream", False)

    # Parsing and tokenizing cost in proportion to the body: on a thread, so /health keeps answering.
    # Bodies past LARGE_BODY queue for one thread of their own: a flood of them then holds the GIL
    # from one thread at a time, and the scheduler's thread keeps its share; small ones never wait.
    large_lane = ThreadPoolExecutor(1, thread_name_prefix="miles-engine-large-body")

    @app.post("/generate", openapi_extra=bodies.openapi_body(bodies.GenerateBody))
    async def generate(request: Request):
        raw = await request.body()
        if len(raw) > LARGE_BODY:
            reqs, batched, streamed = await asyncio.get_running_loop().run_in_executor(large_lane, checked_generate,
                                                                                        raw)
        else:
            reqs, batched, streamed = await asyncio.to_thread(checked_generate, raw)
        if streamed:
            return StreamingResponse(_generate_chunks(engine, reqs[0]), media_type="text/event-stream")
        try:
            results = await asyncio.wrap_future(engine.submit_all(reqs))
        except (asyncio.CancelledError, RequestFailed, EngineStepFailed):
            for r in reqs:  # the client went away, or one item failed the call: free the others' slots
                engine.abort(r.rid)
            raise
        out = [r.to_sglang() for r in results]
        return JSONResponse(out if batched else out[0])

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        if engine.paused or engine.released or engine.unservable:
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
        info = {**engine.config.public_dict(), **model_info(), "context_length": engine.context_length,
                "vocab_size": engine.vocab_size, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "engine_stats": dict(engine.stats)}
        if miles_mode:  # a plain SGLang server has no such key: no extensions
            info[SERVER_INFO_KEY] = weights.extensions()
            # Where it computes (config may say auto): a trainer on the same GPU hands weights over by IPC.
            info["device"] = str(engine.runner.device)
            if engine.runner.device.type == "cuda":
                info["gpu_uuid"] = gpu_uuid(engine.runner.device)
            if engine.quantized:  # the `quantized_weights` extension: which weights may arrive quantized
                info["quantized_weights"] = {n: fmt.name for n, (fmt, _) in engine.quantized.items()}
        info["loaded_lora_adapters"] = engine.lora_adapters()
        return info

    if miles_mode:  # the `engine_load` extension: miles' own state routes
        @app.get("/get_load")
        async def get_load():
            running, waiting = engine.num_requests()
            return {"num_reqs": running + waiting, "num_running_reqs": running, "num_waiting_reqs": waiting,
                    "paused": engine.paused, "released": list(engine.released)}

        @app.get("/get_weight_version")
        async def get_weight_version():
            return {"weight_version": engine.weight_version}

    @app.post("/abort_request", openapi_extra=bodies.openapi_body(bodies.Abort))
    async def abort_request(request: Request):
        req = bodies.parse_body(bodies.Abort, await body_of(request))
        if req.abort_all:
            require_admin(request)  # a client may abort its own request, only an admin everyone's
        elif req.rid is None:
            raise InvalidRequest("rid: send the request id to abort, or abort_all=true")
        engine.abort(None if req.abort_all else req.rid)
        return {"success": True}

    @app.post("/pause_generation", openapi_extra=bodies.openapi_body(bodies.PauseGeneration))
    async def pause_generation(request: Request):
        require_admin(request)
        mode = bodies.parse_body(bodies.PauseGeneration, await body_of(request)).mode
        await asyncio.to_thread(engine.pause, mode)
        return {"success": True, "status": "ok", "message": f"generation paused ({mode})"}

    @app.post("/continue_generation", openapi_extra=bodies.openapi_body(bodies.ContinueGeneration))
    async def continue_generation(request: Request):
        require_admin(request)
        bodies.parse_body(bodies.ContinueGeneration, await body_of(request))
        engine.continue_generation()
        return {"success": True, "status": "ok", "message": "generation continued"}

    def memory_route(name: str, act, done: str) -> None:
        """POST /<name>: an admin call that applies `act` to the memory tags in the body."""
        async def route(request: Request):
            require_admin(request)
            tags = bodies.parse_memory_tags(await body_of(request), MEMORY_TAGS)
            await asyncio.to_thread(act, tags)
            return {"success": True, "message": f"{done} {list(tags)}"}

        app.add_api_route(f"/{name}", route, methods=["POST"], name=name,
                          openapi_extra=bodies.openapi_body(bodies.MemoryTags))

    memory_route("release_memory_occupation", engine.release_memory, "released")
    memory_route("resume_memory_occupation", engine.resume_memory, "resumed")

    async def lora_route(request: Request, body_model, act):
        """SGLang's LoRA routes: 200 {success, loaded_adapters}, or 400 {success: false, error_message}
        with the engine unchanged."""
        require_admin(request)
        try:
            req = bodies.parse_body(body_model, await body_of(request))
            loaded = await asyncio.to_thread(act, req)
        except InvalidRequest as exc:
            return JSONResponse({"success": False, "error_message": str(exc), "error": str(exc),
                                 "loaded_adapters": engine.lora_adapters()}, status_code=400)
        return {"success": True, "error_message": None, "loaded_adapters": loaded}

    @app.post("/load_lora_adapter", openapi_extra=bodies.openapi_body(bodies.LoadLoRAAdapter))
    async def load_lora_adapter(request: Request):
        return await lora_route(request, bodies.LoadLoRAAdapter,
                                lambda r: engine.load_lora_adapter(r.lora_name, r.lora_path, r.pinned))

    @app.post("/unload_lora_adapter", openapi_extra=bodies.openapi_body(bodies.UnloadLoRAAdapter))
    async def unload_lora_adapter(request: Request):
        return await lora_route(request, bodies.UnloadLoRAAdapter, lambda r: engine.unload_lora_adapter(r.lora_name))

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request, timeout: float = 0.0):
        # SGLang's form: no body, an optional `timeout` query parameter (nothing here waits on it).
        require_admin(request)
        engine.flush_cache()
        return {"success": True, "message": "cache flushed"}

    # Weight routes: the shared ones and each registered transport's (miles/sync/transports/<name>.py).
    app.include_router(weights.router)
    # OpenAI-compatible routes (SGLang serves them in both modes: they are SGLang's own).
    add_openai_routes(app, engine, model_info()["served_model_name"])
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
        ("failed_steps_total", "counter", "Batch steps that raised (their requests then ran alone)",
         st["failed_steps"]),
        ("failed_requests_total", "counter", "Requests failed by a step that raised (422 or 503)", st["failed_reqs"]),
        ("num_running_reqs", "gauge", "Requests in the running batch", running),
        ("num_waiting_reqs", "gauge", "Requests waiting for a batch slot", waiting),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP miles_engine_{name} {help_}", f"# TYPE miles_engine_{name} {kind}",
                f"miles_engine_{name} {value}"]
    # Versions are strings (labels), so they ride as a label of a constant gauge, Prometheus' info idiom.
    label = str(engine.weight_version).replace("\\", "\\\\").replace('"', '\\"')
    out += ["# HELP miles_engine_weight_version_info Weight version in force (as its label)",
            "# TYPE miles_engine_weight_version_info gauge", f'miles_engine_weight_version_info{{version="{label}"}} 1']
    return "\n".join(out) + "\n"


@dataclass
class RunningServer:
    """An engine served on a daemon thread of this process."""

    url: str
    engine: object
    http: ServerThread

    def stop(self) -> None:
        self.http.stop()
        self.engine.stop()


# Keep-alive outlives the clients' idle-connection expiry (httpx: 5 s): with equal timeouts a client
# can reuse a connection in the instant the server closes it and get no response at all.
_UVICORN_OPTIONS = {"lifespan": "off", "timeout_graceful_shutdown": 5, "timeout_keep_alive": 65}


def start_server_thread(config: EngineConfig, startup_timeout_s: float = 60.0) -> RunningServer:
    """Load the engine, serve it on a daemon thread, and return once /health answers."""
    from miles.engine.engine import Engine  # torch: only once an engine is built, never at --help

    config.check_admin_exposure()
    engine = Engine(config)
    try:
        http = serve_app(build_app(engine), bind(config.host, config.port), config.host, what="engine server",
                         ready_path="/health", startup_timeout_s=startup_timeout_s, **_UVICORN_OPTIONS)
    except RuntimeError:
        engine.stop()
        raise
    return RunningServer(http.url, engine, http)


_SERVE_USAGE = """usage: miles serve --model DIR [--port P] [--host H] [--admin-token T | --insecure-admin] [--KEY VALUE ...]

Serve a model with the built-in miles engine (SGLang-compatible HTTP API).
--sglang-only true serves SGLang's routes and fields only (no miles extensions).
Every engine setting is a flag, with dashes or underscores: --dtype bfloat16, --max-batch-size 64,
--prefix-cache false (--port=P works too). --port 0 picks a free port and prints the URL.
Without --admin-token the engine binds loopback only; --insecure-admin lets it bind another
--host with every admin route open (only on a trusted network).
--no-prefix-cache and --no-reuse-weight-memory turn those off; --log-level sets Python logging."""


def parse_args(argv=None) -> tuple[EngineConfig, str]:
    """`miles serve` flags, read by the same dotted-key loader as `miles train` (keys of EngineConfig)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    log_level = "warning"
    for i, tok in enumerate(argv):  # not an engine setting: taken out before the config is built
        if tok.startswith("--log-level=") or tok.startswith("--log_level="):
            log_level, argv = tok.split("=", 1)[1], argv[:i] + argv[i + 1:]
            break
        if tok in ("--log-level", "--log_level") and i + 1 < len(argv):
            log_level, argv = argv[i + 1], argv[:i] + argv[i + 2:]
            break
    if not any(t in ("-h", "--help") for t in argv) and not any(
            t.split("=", 1)[0] in ("--model", "--model-path", "--model_path") for t in argv):
        print("miles serve: error: --model DIR is required (a Hugging Face checkpoint directory or hub id)",
              file=sys.stderr)
        raise SystemExit(2)
    cfg = load_server_config(EngineConfig, argv, prog="miles serve", usage=_SERVE_USAGE, aliases={"model": "model_path"},
                             switches={"no_prefix_cache": ("prefix_cache", "false"),
                                       "insecure_admin": ("insecure_admin", "true"),
                                       "no_reuse_weight_memory": ("reuse_weight_memory", "false")})
    try:
        cfg.check_admin_exposure()
    except ConfigError as exc:
        print(f"miles serve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return cfg, log_level


def main(argv=None) -> int:
    """Serve in the foreground until SIGINT/SIGTERM."""
    config, log_level = parse_args(argv)  # before the heavy import: --help answers at once
    import uvicorn

    from miles.engine.engine import Engine

    logging.basicConfig(level=log_level.upper())
    exit_with_parent()  # an engine process started by a ServerProcess ends with its parent
    engine = Engine(config)
    sock = bind(config.host, config.port)
    server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level=log_level, **_UVICORN_OPTIONS))
    # Parents that started us with --port 0 read the URL from this line.
    print(f"miles engine serving {config.model_path} at {url_of(sock, config.host)}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
