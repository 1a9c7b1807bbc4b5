"""An OpenAI-compatible chat endpoint per session, so black-box agent harnesses can drive rollouts.

A harness written against the `openai` client is pointed at `<server>/sessions/<id>/v1` and talks
chat messages; miles records the exact tokens underneath:
  - the first request's messages go through the chat template once and are tokenized once;
  - every later request must repeat the conversation so far (including the assistant replies it
    was given, unchanged) and may append new messages (tool results, user turns); only that
    appended suffix is rendered and tokenized, and the engine's output ids are kept as returned.
A request that rewrites history is refused with 400 rather than silently re-tokenized. The session's
trajectory (`GET /sessions/<id>/trajectory`, or `Session.to_sample()`) has loss mask 1 on model
tokens, 0 on the rest, one logprob per model token and one weight version per model turn.

    POST   /sessions                             -> {"session_id", "base_url"}
    POST   /sessions/{id}/v1/chat/completions    OpenAI chat completion (no streaming, n = 1)
    GET    /sessions/{id}/trajectory             the recorded tokens
    DELETE /sessions/{id}                        forget the session (returns its trajectory)

Served by `miles sessions --engine-url URL --tokenizer DIR` (main below), or in-process with
start_session_server.

Non-goals: streaming, tool-call JSON schemas (tools are plain messages), n > 1, the legacy
/v1/completions route.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from miles.buffer.types import Sample, SampleStatus
from miles.models.loading import load_tokenizer
from miles.net import ServerThread, bind, serve_app
from miles.rollout.agent import ChatFormat
from miles.rollout.generate import versions_of

_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


class SessionError(ValueError):
    """A request the session refuses; the message says what to change (HTTP 400 or 404)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Session:
    id: str
    messages: list[dict] = field(default_factory=list)    # the conversation as the client sees it
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    last_finish: str = "stop"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def trajectory(self) -> dict:
        return {"session_id": self.id, "prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
                "loss_mask": self.loss_mask, "rollout_logprobs": self.logprobs,
                "weight_versions": self.weight_versions, "num_messages": len(self.messages)}

    def to_sample(self, reward: float = 0.0, label: str | None = None, prompt_index: int = -1) -> Sample:
        """The episode as a trainable Sample. Trailing non-model tokens are dropped (nothing to learn)."""
        n = len(self.loss_mask)
        while n and self.loss_mask[n - 1] == 0:
            n -= 1
        status = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}.get(self.last_finish,
                                                                                       SampleStatus.COMPLETED)
        return Sample(prompt_ids=list(self.prompt_ids), response_ids=self.response_ids[:n],
                      rollout_logprobs=self.logprobs[:n], loss_mask=self.loss_mask[:n], reward=reward,
                      status=status, weight_versions=list(self.weight_versions), label=label,
                      prompt_index=prompt_index)


def _message(m, where: str) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise SessionError(f"{where}: each message needs a string 'role' and a 'content'")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text parts are meaningful here
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise SessionError(f"{where}: only text content parts are supported")
        content = "".join(p.get("text", "") for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise SessionError(f"{where}: 'content' must be a string or a list of text parts")
    return {"role": m["role"], "content": content}


class SessionStore:
    """Sessions and the token bookkeeping; talks to one engine (or router) URL."""

    def __init__(self, engine_url: str, tokenizer, model_name: str = "miles", turn_end_token: str = "<|im_end|>",
                 default_max_tokens: int = 64):
        self.engine_url = engine_url.rstrip("/")
        self.tokenizer = tokenizer
        self.fmt = ChatFormat(tokenizer, turn_end_token)
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.sessions: dict[str, Session] = {}
        self._client = None

    def create(self, session_id: str | None = None) -> Session:
        sid = session_id or secrets.token_hex(8)
        if sid in self.sessions:
            raise SessionError(f"session {sid!r} exists already: pick another id or DELETE it first")
        self.sessions[sid] = s = Session(sid)
        return s

    def get(self, sid: str) -> Session:
        if sid not in self.sessions:
            raise SessionError(f"no session {sid!r}: create one with POST /sessions", status=404)
        return self.sessions[sid]

    def pop(self, sid: str) -> Session:
        return self.sessions.pop(self.get(sid).id)

    def _render(self, messages: list[dict], first: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not first:
            text = self.fmt.closer + text
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def complete(self, sid: str, body: dict) -> dict:
        import httpx

        if not isinstance(body, dict):
            raise SessionError("the request body must be a JSON object")
        if body.get("stream"):
            raise SessionError("stream: streaming is not supported; send stream=false")
        if body.get("n", 1) != 1:
            raise SessionError("n: only n=1 is supported; start one session per sample")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise SessionError("messages: send a non-empty list of chat messages")
        messages = [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]
        params = _sampling_params(body, self.default_max_tokens)
        session = self.get(sid)
        async with session.lock:
            first = not session.messages
            if first:
                new_ids = self._render(messages, first=True)
            else:
                k = len(session.messages)
                if messages[:k] != session.messages:
                    at = next(i for i, (a, b) in enumerate(zip(messages, session.messages)) if a != b) \
                        if len(messages) >= k else len(messages)
                    raise SessionError(f"messages: the conversation so far must be sent back unchanged (it differs "
                                       f"at message {at}); the recorded tokens cannot be rewritten — start a new "
                                       "session for a different history")
                appended = messages[k:]
                if not appended:
                    raise SessionError("messages: nothing new since the last reply; append a message")
                if any(m["role"] == "assistant" for m in appended):
                    raise SessionError("messages: assistant turns come from the model; append only tool/user turns")
                new_ids = self._render(appended, first=False)
                if session.last_finish != "closed":
                    new_ids = [self.fmt.end_id] + new_ids  # the last turn was cut off before its end token
            input_ids = new_ids if first else session.prompt_ids + session.response_ids + new_ids
            sp = dict(params, stop_token_ids=[self.fmt.end_id])
            if self._client is None:
                self._client = httpx.AsyncClient(timeout=600)
            resp = await self._client.post(f"{self.engine_url}/generate", json={
                "input_ids": input_ids, "sampling_params": sp, "return_logprob": True, "rid": f"{sid}-{len(messages)}"})
            if resp.status_code != 200:
                raise SessionError(f"the engine refused the request ({resp.status_code}): {resp.text[:300]}",
                                   status=502 if resp.status_code >= 500 else 400)
            out = resp.json()
            meta = out["meta_info"]
            ids = list(out["output_ids"])
            lps = [float(lp) for lp, *_ in meta["output_token_logprobs"]]
            # Commit only after the engine answered, so a failed call leaves the session as it was.
            if first:
                session.prompt_ids = new_ids
            else:
                session.response_ids += new_ids
                session.loss_mask += [0] * len(new_ids)
                session.logprobs += [0.0] * len(new_ids)
            session.response_ids += ids
            session.loss_mask += [1] * len(ids)
            session.logprobs += lps
            session.weight_versions.append(min(versions_of(meta)))
            closed = bool(ids) and ids[-1] == self.fmt.end_id
            finish = meta["finish_reason"]["type"]
            session.last_finish = "closed" if closed else finish
            content = self.tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=True)
            session.messages = messages + [{"role": "assistant", "content": content}]
        prompt_tokens = len(input_ids)
        return {
            "id": f"chatcmpl-{sid}-{len(session.weight_versions)}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": _FINISH.get(finish, "stop"), "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                      "total_tokens": prompt_tokens + len(ids)},
        }

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _sampling_params(body: dict, default_max_tokens: int) -> dict:
    def num(key, default, lo, hi):
        v = body.get(key, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise SessionError(f"{key}: expected a number in [{lo}, {hi}], got {v!r}")
        return v

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise SessionError(f"max_tokens: expected a positive integer, got {max_tokens!r}")
    sp = {"temperature": num("temperature", 1.0, 0.0, 2.0), "top_p": num("top_p", 1.0, 1e-6, 1.0),
          "max_new_tokens": max_tokens}
    if body.get("seed") is not None:
        sp["sampling_seed"] = int(num("seed", 0, 0, 2**63 - 1))
    stop = body.get("stop")
    if stop:
        sp["stop"] = [stop] if isinstance(stop, str) else stop
    return sp


def build_session_router(store: SessionStore) -> APIRouter:
    router = APIRouter()

    @router.post("/sessions")
    async def create(request: Request):
        raw = await request.body()
        body = (await request.json()) if raw else {}
        sid = body.get("session_id") if isinstance(body, dict) else None
        if sid is not None and (not isinstance(sid, str) or not sid.replace("-", "").replace("_", "").isalnum()):
            raise SessionError("session_id: use letters, digits, '-' and '_' only")
        s = store.create(sid)
        return {"session_id": s.id, "base_url": f"{str(request.base_url).rstrip('/')}/sessions/{s.id}/v1"}

    @router.post("/sessions/{sid}/v1/chat/completions")
    async def chat_completions(sid: str, request: Request):
        try:
            body = await request.json()
        except ValueError:
            raise SessionError("the request body is not valid JSON") from None
        return await store.complete(sid, body)

    @router.get("/sessions/{sid}/v1/models")
    async def models(sid: str):
        store.get(sid)
        return {"object": "list", "data": [{"id": store.model_name, "object": "model", "owned_by": "miles"}]}

    @router.get("/sessions/{sid}/trajectory")
    async def trajectory(sid: str):
        return store.get(sid).trajectory()

    @router.delete("/sessions/{sid}")
    async def delete(sid: str):
        return store.pop(sid).trajectory()

    return router


def build_app(store: SessionStore) -> FastAPI:
    app = FastAPI(title="miles sessions")

    @app.exception_handler(SessionError)
    async def _refused(_request, exc: SessionError):
        # OpenAI clients read error.message; keep the shape they expect.
        return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, status_code=exc.status)

    app.include_router(build_session_router(store))
    return app


@dataclass
class RunningSessionServer:
    url: str
    store: SessionStore
    http: ServerThread

    def base_url(self, session_id: str) -> str:
        return f"{self.url}/sessions/{session_id}/v1"

    def new_session(self, session_id: str | None = None) -> Session:
        return self.store.create(session_id)

    def stop(self) -> None:
        self.http.stop()


def start_session_server(engine_url: str, tokenizer_path: str, host: str = "127.0.0.1", port: int = 0,
                         **store_kwargs) -> RunningSessionServer:
    """Serve the session endpoint on a daemon thread in front of `engine_url`; returns once it answers."""
    store = SessionStore(engine_url, load_tokenizer(tokenizer_path), **store_kwargs)
    http = serve_app(build_app(store), bind(host, port), host, what="session server",
                     ready_path="/sessions/none/trajectory", startup_timeout_s=30, lifespan="off")
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
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one and prints the URL")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens when a request gives none")
    a = p.parse_args(argv)
    server = start_session_server(a.engine_url.rstrip("/"), a.tokenizer, a.host, a.port,
                                  default_max_tokens=a.max_tokens)
    print(f"miles sessions at {server.url}: POST {server.url}/sessions to start one", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
