"""The chat-completion request the session endpoint accepts, as typed pydantic models.

A request that does not fit is refused with 400 naming the field (`messages.2.role: ...`) before any
token is rendered, so a harness bug never reaches the engine or the recorded trajectory. Fields that
only change how an answer is presented and that miles cannot honour without changing what is sampled
(`logprobs`, `logit_bias`, penalties, JSON response formats) are refused rather than ignored: the
trajectory must be what the model sampled under the run's own settings.
The /v1/responses body (ResponsesRequest) is mapped onto the same chat messages: message items,
`function_call` items joining the assistant turn before them, `function_call_output` items as
`role: "tool"` messages.
Non-goals: the legacy /v1/completions body, streamed or stored-server-side responses beyond a
session's latest one, built-in (non-function) tools, audio parts. Image parts (OpenAI's and SGLang's
`{"type": "image_url", "image_url": {"url": ...}}`) are typed here; the engine's /v1/chat/completions
serves them to a vision-language model, the session server refuses them.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = "auto"


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(_Model):
    name: str = Field(min_length=1)
    arguments: str = "{}"

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            obj = json.loads(v or "{}")
        except ValueError:
            raise ValueError("arguments must be a JSON object serialized as a string") from None
        if not isinstance(obj, dict):
            raise ValueError("arguments must be a JSON object serialized as a string")
        return v


class ToolCall(_Model):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    def images(self) -> list[str]:
        """The URLs (data: URLs or base64) of its image parts, in order."""
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)] \
            if isinstance(self.content, list) else []

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=dict)
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Model):
    include_usage: bool = False


class ResponseFormat(_Model):
    type: Literal["text"]


class CreateSessionRequest(_Model):
    """POST /sessions: an optional id of the caller's choosing (a fresh one when absent)."""

    session_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]+$")


class ChatCompletionRequest(_Model):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    logprobs: Literal[False] | None = None
    logit_bias: None = None
    presence_penalty: Literal[0, 0.0] | None = None
    frequency_penalty: Literal[0, 0.0] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                                 f"among tools ({names})")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice = 'required' needs a non-empty tools list")
        return self


# What a refused field means, for the 400's message (pydantic's own words say what it expected).
FIELD_HINTS = {
    "n": "start one session per sample; a session records one trajectory",
    "logprobs": "read the exact logprobs from GET /sessions/<id>/trajectory instead",
    "logit_bias": "miles samples under the run's own settings only",
    "presence_penalty": "miles samples under the run's own settings only",
    "frequency_penalty": "miles samples under the run's own settings only",
    "response_format": "constrained (JSON) decoding is not supported; ask for JSON in the prompt",
}


# -- /v1/responses (non-streaming): its input items are mapped onto chat messages -------------------
class ContentPart(_Model):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str = "{}"


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ResponsesTool(_Model):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=dict)
    strict: bool | None = None


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[FunctionCallItem | FunctionCallOutputItem | MessageItem] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | None = None
    stream: Literal[False] = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1)

    def chat_tools(self) -> list[dict] | None:
        if not self.tools:
            return None
        return [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools]

    def new_messages(self) -> list[dict]:
        """The input items as chat messages: an assistant's function calls join the assistant
        message before them (one model turn is one assistant message), call outputs become
        `role: "tool"` messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out


RESPONSES_HINTS = {"stream": "streaming /v1/responses is not supported; send stream=false or use "
                             "/v1/chat/completions with stream=true"}
