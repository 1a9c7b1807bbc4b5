"""One OpenAI chat-completion turn: what every chat-completions route of miles shares.

  - `parse_request`: the body as a typed ChatCompletionRequest (schema.py), or a refusal
    naming the first offending field;
  - `render_prompt`: the request's messages (and tools) through the tokenizer's chat template, once,
    tokenized once;
  - `Completion`, `completion_body`: the answered turn as OpenAI's JSON body;
  - `TurnStream`: the turn as the chunks of an OpenAI stream while it is being generated.

Two routes use them: the session API (store.py, server.py), which adds exact-token bookkeeping across the
turns of one conversation, and the built-in engine's stateless /v1/chat/completions
(engine/openai_routes.py), which answers one request from its messages as SGLang's does.
Non-goals: sessions, budgets, HTTP serving, the tool-call parsers themselves (tool_calls.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from miles.engine_api.chat_schema import FIELD_HINTS, ChatCompletionRequest, ChatMessage


class RequestRefused(ValueError):
    """A request refused; the message says what to change (its HTTP status; the field as `param`)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class Completion:
    """One answered turn, before it is shaped as a JSON body or as SSE chunks."""

    id: str
    created: int
    content: str | None
    tool_calls: list[dict]
    finish_reason: str
    ids: list[int]           # the model's tokens of this turn, as the engine returned them
    prompt_tokens: int

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.ids),
                "total_tokens": self.prompt_tokens + len(self.ids)}


def parse_request(body, model=ChatCompletionRequest, hints=FIELD_HINTS):
    """The typed request, or a RequestRefused naming the first offending field."""
    if not isinstance(body, dict):
        raise RequestRefused("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "request"
        hint = hints.get(str(err["loc"][0]) if err["loc"] else "", "")
        msg = err["msg"].removeprefix("Value error, ")
        raise RequestRefused(f"{loc}: {msg}" + (f" ({hint})" if hint else ""), param=loc) from None


def arguments(raw: str) -> dict:
    """A tool call's `function.arguments` (a JSON object as a string) as the object."""
    return json.loads(raw or "{}")


def template_message(m: ChatMessage) -> dict:
    """A message as HF chat templates read it (tool-call arguments as objects, as Qwen's expect)."""
    d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.images():  # a vision-language template renders one placeholder per image part
        d["content"] = [{"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text}
                        for p in m.content]
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": arguments(c.function.arguments)}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def render_prompt(tokenizer, messages: list[ChatMessage], tools: list[dict] | None) -> list[int]:
    """The conversation through the chat template with the assistant's header opened, as token ids.

    Costs in proportion to the messages: callers on an event loop run it on a thread."""
    try:
        text = tokenizer.apply_chat_template([template_message(m) for m in messages], tools=tools,
                                             add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template's raise_exception or a jinja error: the request's fault
        raise RequestRefused(f"messages: the chat template refused them: {e}", param="messages") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def tools_of(req: ChatCompletionRequest) -> list[dict] | None:
    """The request's tools as the chat template lists them for the model."""
    return [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None


def completion_body(c: Completion, model: str) -> dict:
    message: dict = {"role": "assistant", "content": c.content}
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    return {"id": c.id, "object": "chat.completion", "created": c.created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": c.finish_reason, "logprobs": None}],
            "usage": c.usage()}


class TurnStream:
    """One turn as the chunks of an OpenAI stream, sent while the engine generates it: the role first,
    then content token by token and each tool call as soon as its block is closed (what the parser's
    `settled` says more tokens cannot change), then what the finished turn adds, its finish reason and
    usage. The streamed content and calls add up to the non-streamed reply exactly.

    `decode(ids)` is the turn's text as the caller decodes the finished turn; `parser` None means the
    request's tools are not parsed (content only); `call_id(j)` names the j-th call; `holdback` is how
    many trailing characters to hold while a stop string may still cut them off."""

    def __init__(self, id: str, created: int, model: str, decode, parser=None, call_id=None, holdback: int = 0):
        self.id, self.created, self.model = id, created, model
        self.decode, self.parser, self.call_id, self.holdback = decode, parser, call_id, holdback
        self.sent_content = ""
        self.sent_calls = 0
        self.started = False

    def _chunk(self, delta: dict, finish: str | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    def _start(self) -> list[dict]:
        if self.started:
            return []
        self.started = True
        return [self._chunk({"role": "assistant", "content": ""})]

    def _send(self, content: str, calls: list[dict]) -> list[dict]:
        out = self._start()
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            out.append(self._chunk({"content": content[len(self.sent_content):]}))
            self.sent_content = content
        for call in calls[self.sent_calls:]:
            out.append(self._chunk({"tool_calls": [{"index": self.sent_calls, **call}]}))
            self.sent_calls += 1
        return out

    def feed(self, ids: list[int]) -> list[dict]:
        """The chunks the turn's tokens so far (all of them, not only the new ones) allow."""
        text = self.decode(ids)
        if text.endswith("\ufffd"):
            return self._start()  # a token in the middle of a multi-byte character: wait for the rest
        if self.holdback:
            text = text[:max(0, len(text) - self.holdback)]
        if self.parser is None:
            return self._send(text, [])
        settled = getattr(self.parser, "settled", None)
        if settled is None:
            return self._start()
        turn = settled(text)
        calls = [{"id": self.call_id(j), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for j, c in enumerate(turn.calls)]
        return self._send(turn.content or "", calls)

    def finish(self, c: Completion, include_usage: bool) -> list[dict]:
        """What the finished turn adds, its finish reason and (when asked) usage."""
        out = self._send(c.content or "", c.tool_calls)
        out.append(self._chunk({}, c.finish_reason))
        if include_usage:
            out.append({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.model, "choices": [], "usage": c.usage()})
        return out


def sse_event(chunk: dict) -> str:
    """One chunk as a server-sent event."""
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"  # what ends an OpenAI stream
