"""A session's exact-token bookkeeping: the conversation so far, the token ids the engine saw and
generated, and the turn that extends them.

The first request's messages (and tools) are rendered and tokenized once; every later request must
send the conversation back unchanged and may append tool or user turns, of which only the appended
suffix is rendered (ChatFormat.suffix_ids) and tokenized. A reply is committed only after the engine
answered, so a failed call leaves the session as it was; a session made for a training run enforces
its budget (SessionLimits) and samples under the run's settings.
Non-goals: HTTP (server.py), parsing request bodies (engine_api/chat_completion.py), n > 1.
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

from miles.buffer.types import Sample, SampleStatus
from miles.data.chat import ChatFormat
from miles.engine_api.client import EngineClient
from miles.rollout.generate import versions_of
from miles.engine_api.chat_completion import Completion, RequestRefused, arguments, render_prompt, \
    template_message, tools_of
from miles.engine_api.chat_schema import ChatCompletionRequest, ChatMessage
from miles.engine_api.tool_calls import ParsedTurn, get_tool_parser

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
    # threads when a training run ends an episode (agent/harness.py) while a turn is still generating.
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
