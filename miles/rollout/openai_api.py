"""An OpenAI-compatible chat endpoint per session, so black-box agent harnesses can drive rollouts.

A harness written against the `openai` client is pointed at `<server>/sessions/<id>/v1` and talks
chat messages, with tools if it likes; miles records the exact tokens underneath:
  - the first request's messages (and its `tools`, which the chat template lists for the model) go
    through the chat template once and are tokenized once;
  - every later request must repeat the conversation so far (including the assistant replies it
    was given, tool calls included, unchanged) and may append new messages (`role: "tool"` results,
    user turns); only that appended suffix is rendered (ChatFormat.suffix_ids) and tokenized, and
    the engine's output ids are kept as returned. Nothing is ever re-rendered, so a template that
    rewrites history (Qwen3 drops earlier <think> blocks) cannot make the recorded ids drift.
A request that rewrites history is refused with 400 rather than silently re-tokenized. The model's
text is split into `content` and `tool_calls` by a parser chosen per model family (tool_calls.py);
`finish_reason` is "tool_calls" when it wrote any. The session's trajectory
(`GET /sessions/<id>/trajectory`, or `Session.to_sample()`) has loss mask 1 on model tokens, 0 on
the rest, one logprob per model token and one weight version per model turn.

    POST   /sessions                             -> {"session_id", "base_url"}
    POST   /sessions/{id}/v1/chat/completions    OpenAI chat completion (tools, stream, n = 1)
    POST   /sessions/{id}/v1/responses           OpenAI Responses (function tools, previous_response_id,
                                                 no streaming), mapped onto the same chat turns
    GET    /sessions/{id}/v1/models              the one model name
    GET    /sessions/{id}/trajectory             the recorded tokens
    DELETE /sessions/{id}                        forget the session (returns its trajectory)

`stream: true` answers with the SSE chunks the `openai` client reads, sent while the engine streams
the turn (/generate with `stream: true`): the role, content token by token, each tool call as soon
as its block is closed, the finish reason, usage when `stream_options.include_usage` (TurnStream).
The recorded tokens are the engine's whole turn either way. A session made for a training run
(`miles train` with rollout.generate_fn = "harness") has an API key, a turn and token budget, and
samples under the run's temperature/top_p/top_k whatever the request asks, because the trainer's
logprobs assume them.

Served by `miles sessions --engine-url URL --tokenizer DIR` (main below), or in-process with
start_session_server. What one chat turn needs whatever serves it (request parsing, the first
rendering, the OpenAI bodies and chunks) is chat_completion.py's, shared with the engine's own
stateless /v1/chat/completions.

Non-goals: n > 1 (refused: one session is one trajectory), constrained decoding (`tool_choice =
"required"` or a named function does not force a call), the legacy /v1/completions route, streamed
responses from /v1/responses, and previous_response_id naming anything but the session's latest response.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass, field

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from miles.buffer.types import Sample, SampleStatus
from miles.engine_api.bodies import openapi_body
from miles.engine_api.client import EngineClient
from miles.engine_api.errors import InvalidRequest
from miles.engine_api.parsing import parse_json
from miles.models.loading import load_tokenizer
from miles.net import DEFAULT_MAX_BODY_MB, LOOPBACK, BodyLimit, ServerThread, bind, serve_app
from miles.registry import RegistryError
from miles.rollout.chat_completion import SSE_DONE, Completion, RequestRefused, TurnStream, arguments, \
    completion_body, parse_request, render_prompt, sse_event, template_message, tools_of
from miles.rollout.chat_format import ChatFormat
from miles.rollout.generate import versions_of
from miles.rollout.openai_schema import RESPONSES_HINTS, ChatCompletionRequest, ChatMessage, CreateSessionRequest, \
    ResponsesRequest
from miles.rollout.tool_calls import ParsedTurn, get_tool_parser

_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


class SessionError(RequestRefused):
    """A request the session refuses; the message says what to change (HTTP 400, 401 or 404)."""


@dataclass
class SessionLimits:
    """What a session made for a training run enforces; the defaults (None) leave a session open."""

    max_turns: int | None = None             # model turns; past it requests are refused
    max_response_tokens: int | None = None   # everything after the prompt, model and appended tokens
    max_new_tokens: int | None = None        # per model turn: the request's max_tokens is capped at it
    sampling: dict | None = None             # engine sampling params that override the request's


@dataclass
class Session:
    id: str
    engine_url: str | None = None   # None: the store's
    api_key: str | None = None      # required as `Authorization: Bearer <key>` when set
    limits: SessionLimits = field(default_factory=SessionLimits)
    messages: list[dict] = field(default_factory=list)    # the conversation, canonical (see _canonical)
    tools: list[dict] | None = None                       # the first request's tools (the prompt lists them)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    last_finish: str = "stop"
    last_content: str = ""   # the latest reply's content, for a reward over the final answer
    exhausted: str = ""      # why the budget refused a turn ("" while it has not)
    history: list[dict] = field(default_factory=list)  # the conversation as chat messages, for /v1/responses
    last_response_id: str = ""                         # what previous_response_id may name
    closed: bool = False     # its episode is over: a reply still in flight is not recorded
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Held while a reply is committed and while the session is closed, which happen on different
    # threads when a training run ends an episode (harness.py) while a turn is still generating.
    commit_lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        """End the episode: once this returns, the recorded tokens no longer change."""
        with self.commit_lock:
            self.closed = True

    def trajectory(self) -> dict:
        return {"session_id": self.id, "prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
                "loss_mask": self.loss_mask, "rollout_logprobs": self.logprobs,
                "weight_versions": self.weight_versions, "num_messages": len(self.messages),
                "finish_reason": self.last_finish, "exhausted": self.exhausted}

    def to_sample(self, reward: float = 0.0, label: str | None = None, prompt_index: int = -1) -> Sample:
        """The episode as a trainable Sample. Trailing non-model tokens are dropped (nothing to learn)."""
        n = len(self.loss_mask)
        while n and self.loss_mask[n - 1] == 0:
            n -= 1
        status = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}.get(self.last_finish,
                                                                                       SampleStatus.COMPLETED)
        if self.exhausted:
            status = SampleStatus.TRUNCATED
        return Sample(prompt_ids=list(self.prompt_ids), response_ids=self.response_ids[:n],
                      rollout_logprobs=self.logprobs[:n], loss_mask=self.loss_mask[:n], reward=reward,
                      status=status, weight_versions=list(self.weight_versions), label=label,
                      prompt_index=prompt_index, response_text=self.last_content)


def _canonical(m: ChatMessage) -> dict:
    """What must match when a client sends history back: role, text and calls (ids and argument
    formatting may differ between clients)."""
    d: dict = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        d["tool_calls"] = [[c.function.name, arguments(c.function.arguments)] for c in m.tool_calls]
    return d


class SessionStore:
    """Sessions and the token bookkeeping; talks to one engine (or router) URL unless a session names its own."""

    def __init__(self, engine_url: str, tokenizer, model_name: str = "miles", turn_end_token: str = "<|im_end|>",
                 default_max_tokens: int = 64, tool_parser: str = "hermes"):
        self.engine_url = engine_url.rstrip("/")
        self.tokenizer = tokenizer
        self.fmt = ChatFormat(tokenizer, turn_end_token)
        self.parser = get_tool_parser(tool_parser)
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.sessions: dict[str, Session] = {}
        self._client: httpx.AsyncClient | None = None

    def create(self, session_id: str | None = None, *, engine_url: str | None = None, api_key: str | None = None,
               limits: SessionLimits | None = None) -> Session:
        sid = session_id or secrets.token_hex(8)
        if sid in self.sessions:
            raise SessionError(f"session {sid!r} exists already: pick another id or DELETE it first")
        self.sessions[sid] = s = Session(sid, engine_url=engine_url.rstrip("/") if engine_url else None,
                                         api_key=api_key, limits=limits or SessionLimits())
        return s

    def get(self, sid: str) -> Session:
        if sid not in self.sessions:
            raise SessionError(f"no session {sid!r}: create one with POST /sessions", status=404)
        return self.sessions[sid]

    def pop(self, sid: str) -> Session:
        return self.sessions.pop(self.get(sid).id)

    def authorize(self, sid: str, authorization: str | None) -> Session:
        session = self.get(sid)
        if session.api_key is not None and not hmac.compare_digest(
                (authorization or "").encode(), f"Bearer {session.api_key}".encode()):
            raise SessionError("this session needs its API key: send 'Authorization: Bearer <key>' (the openai "
                               "client does when api_key is set, e.g. from OPENAI_API_KEY)", status=401)
        return session

    def _render_suffix(self, messages: list[dict], closed: bool) -> list[int]:
        try:
            return self.fmt.suffix_ids(messages, closed)
        except Exception as e:  # noqa: BLE001 - as in _render_first
            raise SessionError(f"messages: the chat template refused the appended messages: {e}",
                               param="messages") from None

    async def complete(self, sid: str, req: ChatCompletionRequest, authorization: str | None = None,
                       on_tokens=None) -> Completion:
        """Generate the session's next turn. `on_tokens(turn, ids)`, when given, is called with the turn's
        number and all its model tokens so far each time the engine streams more (streamed replies)."""
        session = self.authorize(sid, authorization)
        tools = tools_of(req)
        canon = [_canonical(m) for m in req.messages]
        async with session.lock:
            if session.exhausted:
                raise SessionError(f"this session's budget is spent ({session.exhausted}); the episode is over")
            first = not session.messages
            # Rendering and tokenizing cost in proportion to the messages: on a thread, off the event loop.
            if first:
                new_ids = await asyncio.to_thread(render_prompt, self.tokenizer, req.messages, tools)
                session_tools = tools
            else:
                if tools != session.tools:
                    raise SessionError("tools: send the same tools on every request of a session (the first "
                                       "request's tools are in the prompt already)", param="tools")
                k = len(session.messages)
                if canon[:k] != session.messages:
                    at = next((i for i, (a, b) in enumerate(zip(canon, session.messages)) if a != b), len(canon))
                    raise SessionError(f"messages: the conversation so far must be sent back unchanged (it differs "
                                       f"at message {at}); the recorded tokens cannot be rewritten — start a new "
                                       "session for a different history", param="messages")
                appended = req.messages[k:]
                if not appended:
                    raise SessionError("messages: nothing new since the last reply; append a message")
                if any(m.role == "assistant" for m in appended):
                    raise SessionError("messages: assistant turns come from the model; append only tool/user turns")
                new_ids = await asyncio.to_thread(self._render_suffix, [template_message(m) for m in appended],
                                                  session.last_finish == "closed")
                session_tools = session.tools
            params = self._sampling(req, session, 0 if first else len(new_ids))  # the prompt is not budgeted
            input_ids = new_ids if first else session.prompt_ids + session.response_ids + new_ids
            turn = len(session.weight_versions) + 1
            listener = None if on_tokens is None else (lambda ids: on_tokens(turn, ids))
            out = await self._generate(session, input_ids, params, f"{sid}-{turn - 1}", listener)
            meta = out["meta_info"]
            ids = list(out["output_ids"])
            lps = [float(lp) for lp, *_ in meta["output_token_logprobs"]]
            if len(lps) != len(ids):
                raise SessionError(f"the engine returned {len(ids)} tokens but {len(lps)} logprobs", status=502)
            closed = bool(ids) and ids[-1] == self.fmt.end_id
            finish = meta["finish_reason"]["type"]
            text = self.text(ids)
            parser = self.parser_for(req)
            parsed = parser.parse(text) if parser is not None else ParsedTurn(text)
            calls = [{"id": call_id(sid, turn, j), "type": "function",
                      "function": {"name": c.name, "arguments": c.arguments}} for j, c in enumerate(parsed.calls)]
            # Commit only after the engine answered, so a failed call leaves the session as it was.
            with session.commit_lock:
                if session.closed:
                    raise SessionError("this session's episode is over (it timed out or was ended)", status=409)
                if first:
                    session.prompt_ids = new_ids
                    session.tools = session_tools
                else:
                    session.response_ids += new_ids
                    session.loss_mask += [0] * len(new_ids)
                    session.logprobs += [0.0] * len(new_ids)
                session.response_ids += ids
                session.loss_mask += [1] * len(ids)
                session.logprobs += lps
                session.weight_versions.append(min(versions_of(meta)))
                session.last_finish = "closed" if closed else finish
                session.last_content = parsed.content or ""
                session.messages = canon + [{"role": "assistant", "content": parsed.content or "", **(
                    {"tool_calls": [[c.name, json.loads(c.arguments)] for c in parsed.calls]} if calls else {})}]
                session.history = [m.model_dump(exclude_none=True) for m in req.messages] + [
                    {"role": "assistant", "content": parsed.content, **({"tool_calls": calls} if calls else {})}]
                session.last_response_id = f"resp_{sid}_{turn}"
                self._check_budget(session)
        reason = "tool_calls" if calls else _FINISH.get(finish, "stop")
        return Completion(completion_id(sid, turn), int(time.time()), parsed.content, calls, reason, ids,
                          len(input_ids))

    def text(self, ids: list[int]) -> str:
        """A model turn's text, without the token that closed it."""
        closed = bool(ids) and ids[-1] == self.fmt.end_id
        return self.tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=True)

    def parser_for(self, req: ChatCompletionRequest):
        """The tool-call parser for the request's reply; None when it offers no tools or tool_choice = none."""
        return self.parser if req.tools and req.tool_choice != "none" else None

    def _sampling(self, req: ChatCompletionRequest, session: Session, appended: int) -> dict:
        max_tokens = req.max_completion_tokens or req.max_tokens or self.default_max_tokens
        sp: dict = {"temperature": 1.0 if req.temperature is None else req.temperature,
                    "top_p": 1.0 if req.top_p is None else req.top_p}
        if req.seed is not None:
            sp["sampling_seed"] = req.seed
        if req.stop:
            sp["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        lim = session.limits
        if lim.max_new_tokens is not None:
            max_tokens = min(req.max_completion_tokens or req.max_tokens or lim.max_new_tokens, lim.max_new_tokens)
        if lim.sampling:
            sp.update(lim.sampling)
            if "sampling_seed" in lim.sampling:  # a fresh draw per turn, reproducible per episode
                sp["sampling_seed"] = (lim.sampling["sampling_seed"] + 7919 * len(session.weight_versions)) \
                    & 0x7FFFFFFF
        if lim.max_response_tokens is not None:
            left = lim.max_response_tokens - len(session.response_ids) - appended
            if left <= 0:
                session.exhausted = f"max_response_tokens = {lim.max_response_tokens} reached"
                raise SessionError(f"this session's budget is spent ({session.exhausted}); the episode is over")
            max_tokens = min(max_tokens, left)
        sp["max_new_tokens"] = max_tokens
        sp["stop_token_ids"] = [self.fmt.end_id]
        return sp

    def _check_budget(self, session: Session) -> None:
        lim = session.limits
        if lim.max_turns is not None and len(session.weight_versions) >= lim.max_turns:
            session.exhausted = f"max_turns = {lim.max_turns} reached"
        elif lim.max_response_tokens is not None and len(session.response_ids) >= lim.max_response_tokens:
            session.exhausted = f"max_response_tokens = {lim.max_response_tokens} reached"

    async def _generate(self, session: Session, input_ids: list[int], sp: dict, rid: str, listener=None) -> dict:
        """The engine's answer (SGLang's /generate body). With `listener`, the engine streams and
        listener(ids) gets the turn's tokens so far after every chunk."""
        if self._client is None:
            self._client = EngineClient.async_http(600)
        url = session.engine_url or self.engine_url
        body = {"input_ids": input_ids, "sampling_params": sp, "return_logprob": True, "rid": rid}
        try:
            if listener is None:
                resp = await self._client.post(f"{url}/generate", json=body)
                _check_engine_status(resp.status_code, resp.text)
                return resp.json()
            async with self._client.stream("POST", f"{url}/generate", json={**body, "stream": True}) as resp:
                if resp.status_code != 200:
                    _check_engine_status(resp.status_code, (await resp.aread()).decode(errors="replace"))
                return await _read_stream(resp, listener, url)
        except httpx.HTTPError as e:
            raise SessionError(f"the engine at {url} could not be reached: {e}", status=502) from None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def completion_id(sid: str, turn: int) -> str:
    return f"chatcmpl-{sid}-{turn}"


def call_id(sid: str, turn: int, j: int) -> str:
    return f"call_{sid}_{turn}_{j}"


def _check_engine_status(status: int, text: str) -> None:
    if status != 200:
        raise SessionError(f"the engine refused the request ({status}): {text[:300]}",
                           status=502 if status >= 500 else 400)


async def _read_stream(resp: httpx.Response, listener, url: str) -> dict:
    """A streamed /generate read to its end: the last chunk, with the output ids and logprobs of the
    whole turn. SGLang sends each chunk's ids either as all so far (its default) or as only the new
    ones (--incremental-streaming-output); meta_info.completion_tokens tells them apart."""
    ids: list[int] = []
    lps: list = []
    last = None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise SessionError(f"the engine at {url} failed the turn: {chunk['error']}", status=502)
        meta = chunk["meta_info"]
        new, new_lps = list(chunk["output_ids"]), meta.get("output_token_logprobs") or []
        if len(new) == meta["completion_tokens"]:
            ids, lps = new, new_lps
        else:
            ids, lps = ids + new, lps + new_lps
        last = chunk
        if meta.get("finish_reason") is None:
            listener(ids)
    if last is None or last["meta_info"].get("finish_reason") is None:
        raise SessionError(f"the engine at {url} ended the stream before the turn finished", status=502)
    last["output_ids"] = ids
    last["meta_info"]["output_token_logprobs"] = lps
    return last


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
    p.add_argument("--tool-parser", default="hermes", help="how the model writes tool calls: hermes (Qwen2.5/Qwen3), "
                   "llama3_json, none, or module:Class")
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
