"""The session server: an OpenAI-compatible chat endpoint per session, served over HTTP, so
black-box agent harnesses can drive rollouts (the recorded tokens are store.py's).

    POST   /sessions                             -> {"session_id", "base_url"}
    POST   /sessions/{id}/v1/chat/completions    OpenAI chat completion (tools, stream, n = 1)
    POST   /sessions/{id}/v1/responses           OpenAI Responses (function tools, previous_response_id,
                                                 no streaming), mapped onto the same chat turns
    GET    /sessions/{id}/v1/models              the one model name
    GET    /sessions/{id}/trajectory             the recorded tokens
    DELETE /sessions/{id}                        forget the session (returns its trajectory)

`stream: true` answers with the SSE chunks the `openai` client reads, sent while the engine streams
the turn: the role, content token by token, each tool call as soon as its block is closed, the
finish reason, usage when `stream_options.include_usage` (TurnStream). Served by `miles sessions
--engine-url URL --tokenizer DIR` (main below), or in-process with start_session_server.
Non-goals: streamed responses from /v1/responses, previous_response_id naming anything but the
session's latest response, the legacy /v1/completions route.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from miles.models.loading import load_tokenizer
from miles.net import DEFAULT_MAX_BODY_MB, LOOPBACK, BodyLimit, ServerThread, bind, serve_app
from miles.registry import RegistryError
from miles.engine_api.bodies import openapi_body
from miles.engine_api.parsing import parse_json
from miles.engine_api.errors import InvalidRequest
from miles.engine_api.chat_completion import SSE_DONE, Completion, RequestRefused, TurnStream, \
    completion_body, parse_request, sse_event
from miles.engine_api.chat_schema import RESPONSES_HINTS, ChatCompletionRequest, CreateSessionRequest, \
    ResponsesRequest
from miles.rollout.sessions.store import Session, SessionError, SessionStore, call_id, completion_id
from miles.engine_api.tool_calls import TOOL_PARSERS

def response_body(c: Completion, req: ResponsesRequest, response_id: str, model: str) -> dict:
    """The turn as a /v1/responses object: a message item for its text, a function_call item per call."""
    output: list[dict] = []
    if c.content:
        output.append({"type": "message", "id": f"msg_{response_id}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": c.content, "annotations": []}]})
    for call in c.tool_calls:
        output.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    truncated = c.finish_reason == "length"
    return {"id": response_id, "object": "response", "created_at": c.created, "model": model,
            "status": "incomplete" if truncated else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None, "error": None,
            "instructions": req.instructions, "metadata": {}, "output": output, "parallel_tool_calls": True,
            "previous_response_id": req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "usage": {"input_tokens": c.prompt_tokens, "output_tokens": len(c.ids),
                      "total_tokens": c.prompt_tokens + len(c.ids), "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


async def _json_body(request: Request, empty_ok: bool = False) -> dict:
    """The body as a JSON object, or a SessionError (400) saying what is wrong with it: malformed,
    nested too deeply, holding text that is not Unicode (see engine_api.parsing.parse_json)."""
    raw = await request.body()
    if empty_ok and not raw.strip():
        return {}
    try:
        return await asyncio.to_thread(parse_json, raw)
    except InvalidRequest as e:
        raise SessionError(str(e)) from None


def build_session_router(store: SessionStore) -> APIRouter:
    router = APIRouter()

    @router.post("/sessions", openapi_extra=openapi_body(CreateSessionRequest))
    async def create(request: Request):
        body = await _json_body(request, empty_ok=True)
        sid = body.get("session_id")
        if sid is not None and (not isinstance(sid, str) or not sid.replace("-", "").replace("_", "").isalnum()):
            raise SessionError("session_id: use letters, digits, '-' and '_' only", param="session_id")
        s = store.create(sid)
        return {"session_id": s.id, "base_url": f"{str(request.base_url).rstrip('/')}/sessions/{s.id}/v1"}

    @router.post("/sessions/{sid}/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(sid: str, request: Request):
        req = parse_request(await _json_body(request))
        if any(m.images() for m in req.messages):
            raise RequestRefused("messages: image parts are not supported by the session server (its turns are "
                                 "recorded as token ids only); send text", param="messages")
        auth = request.headers.get("authorization")
        if not req.stream:
            return completion_body(await store.complete(sid, req, auth), store.model_name)
        return await _streamed(store, sid, req, auth)

    @router.post("/sessions/{sid}/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
    async def responses(sid: str, request: Request):
        req = parse_request(await _json_body(request), ResponsesRequest, RESPONSES_HINTS)
        auth = request.headers.get("authorization")
        session = store.authorize(sid, auth)
        if req.previous_response_id is not None:
            if req.previous_response_id != session.last_response_id:
                raise SessionError(f"previous_response_id: {req.previous_response_id!r} is not this session's "
                                   f"latest response ({session.last_response_id or 'none yet'}); a session continues "
                                   "from its latest response only", param="previous_response_id")
            # The first request's instructions are in the prompt already; they cannot change.
            messages = session.history + req.new_messages()
        else:
            messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) \
                + req.new_messages()
        chat = {"messages": messages, "tools": req.chat_tools(), "tool_choice": req.tool_choice,
                "temperature": req.temperature, "top_p": req.top_p, "max_tokens": req.max_output_tokens}
        c = await store.complete(sid, parse_request({k: v for k, v in chat.items() if v is not None}), auth)
        return response_body(c, req, f"resp_{sid}_{c.id.rsplit('-', 1)[1]}", store.model_name)

    @router.get("/sessions/{sid}/v1/models")
    async def models(sid: str, request: Request):
        store.authorize(sid, request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": store.model_name, "object": "model", "owned_by": "miles"}]}

    @router.get("/sessions/{sid}/trajectory")
    async def trajectory(sid: str):
        return store.get(sid).trajectory()

    @router.delete("/sessions/{sid}")
    async def delete(sid: str):
        return store.pop(sid).trajectory()

    return router


async def _streamed(store: SessionStore, sid: str, req: ChatCompletionRequest, auth: str | None):
    """A streamed turn: the chunks go out as the engine streams the tokens. A request refused before
    its first token gets its status and error body as a non-streamed one would; a failure later ends
    the stream with an error event (the openai client raises it)."""
    events: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(store.complete(sid, req, auth, lambda turn, ids: events.put_nowait((turn, ids))))
    task.add_done_callback(lambda _: events.put_nowait(None))
    first = await events.get()
    if first is None:
        c = task.result()  # raises the refusal, answered as JSON with its status
        turn = int(c.id.rsplit("-", 1)[1])
    else:
        turn = first[0]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    ts = TurnStream(completion_id(sid, turn), int(time.time()), store.model_name, store.text, store.parser_for(req),
                    lambda j: call_id(sid, turn, j), max((len(x) for x in _stops(req)), default=0))

    async def chunks():
        event = first
        try:
            while event is not None:
                for chunk in ts.feed(event[1]):
                    yield sse_event(chunk)
                event = await events.get()
            for chunk in ts.finish(task.result(), include_usage):
                yield sse_event(chunk)
        except RequestRefused as e:
            yield sse_event({"error": {"message": str(e), "type": "invalid_request_error", "param": e.param,
                                       "code": e.status}})
        finally:
            if not task.done():  # the client went away mid-turn; the episode's own timeout ends the session
                task.cancel()
        yield SSE_DONE

    return StreamingResponse(chunks(), media_type="text/event-stream")


def _stops(req: ChatCompletionRequest) -> list[str]:
    return [] if not req.stop else [req.stop] if isinstance(req.stop, str) else list(req.stop)


def build_app(store: SessionStore, max_request_mb: float = DEFAULT_MAX_BODY_MB) -> FastAPI:
    app = FastAPI(title="miles sessions")
    app.add_middleware(BodyLimit, max_bytes=int(max_request_mb * (1 << 20)))

    @app.exception_handler(RequestRefused)
    async def _refused(_request, exc: RequestRefused):
        # OpenAI clients read error.message (and error.param); keep the shape they expect.
        kind = {401: "authentication_error", 404: "not_found_error"}.get(exc.status, "invalid_request_error")
        return JSONResponse({"error": {"message": str(exc), "type": kind, "param": exc.param, "code": None}},
                            status_code=exc.status)

    app.include_router(build_session_router(store))
    return app


@dataclass
class RunningSessionServer:
    url: str
    store: SessionStore
    http: ServerThread

    def base_url(self, session_id: str) -> str:
        return f"{self.url}/sessions/{session_id}/v1"

    def new_session(self, session_id: str | None = None, **kwargs) -> Session:
        """A session (SessionStore.create's keywords: engine_url, api_key, limits)."""
        return self.store.create(session_id, **kwargs)

    def stop(self) -> None:
        self.http.stop()


def start_session_server(engine_url: str, tokenizer_path: str | None = None, host: str = LOOPBACK, port: int = 0,
                         *, tokenizer=None, **store_kwargs) -> RunningSessionServer:
    """Serve the session endpoint on a daemon thread in front of `engine_url`; returns once it answers.
    Give the tokenizer's directory, or the loaded `tokenizer`."""
    try:
        store = SessionStore(engine_url, tokenizer if tokenizer is not None else load_tokenizer(tokenizer_path),
                             **store_kwargs)
    except RegistryError as e:
        raise ValueError(f"tool_parser: {e}") from None
    http = serve_app(build_app(store), bind(host, port), host, what="session server",
                     ready_path="/sessions/none/trajectory", startup_timeout_s=30, lifespan="off",
                     timeout_graceful_shutdown=5)  # a client that never closes its stream cannot hold the exit
    return RunningSessionServer(http.url, store, http)


def main(argv: list[str] | None = None) -> int:
    """`miles sessions`: the session API in front of an engine (or router) that is already serving,
    until interrupted. Each harness run creates a session, drives it with the `openai` client and
    reads the exact tokens back from its trajectory."""
    import argparse

    p = argparse.ArgumentParser(prog="miles sessions", description="Serve OpenAI-compatible chat sessions that "
                                "record exact tokens, in front of an engine speaking the engine HTTP API.")
    p.add_argument("--engine-url", required=True, help="the engine or router to generate with")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (the served model's checkpoint)")
    p.add_argument("--host", default=LOOPBACK, help="interface to bind (default loopback)")
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one and prints the URL")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens when a request gives none")
    p.add_argument("--tool-parser", default="hermes", help="how the model writes tool calls: "
                   f"{', '.join(TOOL_PARSERS.names())}, or module:Class")
    p.add_argument("--turn-end-token", default="<|im_end|>", help="the token that closes a turn in the template")
    a = p.parse_args(argv)
    try:
        server = start_session_server(a.engine_url.rstrip("/"), a.tokenizer, a.host, a.port,
                                      default_max_tokens=a.max_tokens, tool_parser=a.tool_parser,
                                      turn_end_token=a.turn_end_token)
    except ValueError as e:
        p.error(str(e))
    print(f"miles sessions at {server.url}: POST {server.url}/sessions to start one", flush=True)
    try:
        # Short waits, not one endless one: the kernel may hand SIGINT to a server thread, and the main
        # thread runs Python's handler only once its wait returns.
        idle = threading.Event()
        while not idle.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
