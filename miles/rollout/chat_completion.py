"""One OpenAI chat-completion turn: what every chat-completions route of miles shares.

  - `parse_request`: the body as a typed ChatCompletionRequest (openai_schema.py), or a refusal
    naming the first offending field;
  - `render_prompt`: the request's messages (and tools) through the tokenizer's chat template, once,
    tokenized once;
  - `Completion`, `completion_body`, `completion_chunks`: the answered turn as OpenAI's JSON body or
    as the chunks of a stream.

Two routes use them: the session API (openai_api.py), which adds exact-token bookkeeping across the
turns of one conversation, and the built-in engine's stateless /v1/chat/completions
(engine/openai_routes.py), which answers one request from its messages as SGLang's does.
Non-goals: sessions, budgets, HTTP serving, the tool-call parsers themselves (tool_calls.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from miles.rollout.openai_schema import FIELD_HINTS, ChatCompletionRequest, ChatMessage


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


def completion_chunks(c: Completion, model: str, tokenizer, include_usage: bool) -> list[dict]:
    """The turn as the chunks of an OpenAI stream: content token by token (when it has no tool calls,
    whose text is not content), then one delta per call, then the finish reason and usage."""
    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    out = [chunk({"role": "assistant", "content": ""})]
    content = c.content or ""
    pieces = [content] if content else []
    if content and not c.tool_calls:
        pieces, seen = [], ""
        for i in range(1, len(c.ids) + 1):
            text = tokenizer.decode(c.ids[:i], skip_special_tokens=True)
            if text.endswith("\ufffd") or not text.startswith(seen):
                continue  # a token in the middle of a multi-byte character: wait for the rest
            if text != seen:
                pieces.append(text[len(seen):])
                seen = text
        if "".join(pieces) != content:
            pieces = [content]
    out += [chunk({"content": p}) for p in pieces]
    out += [chunk({"tool_calls": [{"index": j, **call}]}) for j, call in enumerate(c.tool_calls)]
    out.append(chunk({}, c.finish_reason))
    if include_usage:
        out.append({"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": model,
                    "choices": [], "usage": c.usage()})
    return out


def sse(chunks: list[dict]):
    """The chunks as server-sent events, ending with OpenAI's `[DONE]`."""
    for ch in chunks:
        yield f"data: {json.dumps(ch, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
