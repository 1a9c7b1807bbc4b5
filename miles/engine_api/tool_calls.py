"""Tool-call parsers: how a model family writes a function call in its text, read back into OpenAI
`tool_calls`.

A parser turns the decoded text of one model turn into the reply's `content` (what is left once the
calls are taken out, None when nothing is) and its calls (function name, JSON arguments). The
session server (store.py) and the built-in engine's /v1/chat/completions
(engine/openai_routes.py, `tool_call_parser`) pick one per model family by name; a user's own parser
is given as `module:attr` and must implement the ToolCallParser protocol.

  hermes (aliases qwen3, qwen2.5): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
      block per call, as Hermes, Qwen2.5 and Qwen3 chat templates teach their models.
  llama3_json: the whole turn is one JSON object `{"name": ..., "parameters": {...}}`, as Llama 3.1
      and 3.2 templates teach their models (JSON-based tool calling).
  none: never parses; the whole turn is content.

Parsing only reads text: the tokens the model produced are recorded as they were whether or not a
call parses, and a block that is not valid JSON stays in `content` (the harness sees what the model
wrote; the trainer sees the same tokens either way).
A streamed turn sends what a parser's `settled` says more tokens cannot change: content as it comes,
each call once its block closes. Non-goals: constrained decoding (a call is never forced), deltas of
a call's arguments while they are being written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

from miles.registry import Registry


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's `function.arguments` carries it


@dataclass(frozen=True)
class ParsedTurn:
    content: str | None
    calls: tuple[ParsedCall, ...] = ()


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn:
        """Split one model turn's text into content and tool calls."""


class StreamingToolCallParser(ToolCallParser, Protocol):
    """A parser that can also say, of a turn still being generated, what more tokens cannot change:
    streamed replies send that content and those calls at once (chat_completion.TurnStream). A parser
    without `settled` streams its turn's content and calls when the turn ends."""

    def settled(self, text: str) -> ParsedTurn:
        """The content and calls of `text` (a turn so far) that any continuation keeps: its content a
        prefix of the finished turn's content, its calls the finished turn's first calls."""


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks anywhere in the turn (Hermes, Qwen2.5, Qwen3)."""

    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    _open, _close = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ParsedCall] = []
        kept: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            call = _call_of(m.group(1))
            if call is None:
                continue  # not a well-formed call: it stays part of the content
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        content = text
        if calls:
            # Whitespace around the calls goes; text the turn opened with keeps its indentation, so
            # the content streamed before the first call (settled) stays a prefix of this one.
            content = "".join(kept).rstrip()
            content = content if kept[0].strip() else content.lstrip()
        return ParsedTurn(content or None, tuple(calls))

    def settled(self, text: str) -> ParsedTurn:
        # An opened block that is not closed yet, or the start of an opening tag, may still become a call.
        cut = text.rfind(self._open)
        if cut == -1 or text.find(self._close, cut) != -1:
            cut = len(text) - _partial_tail(text, self._open)
        turn = self.parse(text[:cut])
        # Trailing whitespace may yet be dropped (before a call) or kept: hold it back.
        return ParsedTurn((turn.content or "").rstrip() or None, turn.calls)


class Llama3JsonParser:
    """A turn that is exactly one JSON call object (Llama 3.1/3.2 JSON tool calling); otherwise content."""

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        call = _call_of(body) if body.startswith("{") else None
        return ParsedTurn(None, (call,)) if call is not None else ParsedTurn(text)

    def settled(self, text: str) -> ParsedTurn:
        body = text.lstrip()
        if not body or body.startswith("{") or "<|python_tag|>".startswith(body[:14]):
            return ParsedTurn(None)  # may still be (or become) a call: nothing is settled until it ends
        return ParsedTurn(text)


class NoParser:
    """Tools are never parsed: the turn is all content."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(text)

    def settled(self, text: str) -> ParsedTurn:
        return ParsedTurn(text)


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _call_of(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments already serialized
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


TOOL_PARSERS: Registry[type[ToolCallParser]] = Registry(
    "tool-call parser", protocol=ToolCallParser,
    hint=" (a class with parse(text) -> ParsedTurn, see miles/rollout/tool_calls.py)")
for _name in ("hermes", "qwen3", "qwen2.5"):
    TOOL_PARSERS.register(_name, HermesParser)
TOOL_PARSERS.register("llama3_json", Llama3JsonParser)
TOOL_PARSERS.register("none", NoParser)


def get_tool_parser(spec: str) -> ToolCallParser:
    """A parser instance for `spec` (registry name or module:attr); RegistryError names the choices."""
    return TOOL_PARSERS.get(spec)()
