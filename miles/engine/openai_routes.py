"""The built-in engine's OpenAI-compatible routes, served as SGLang serves them.

    GET  /v1/models               the served model (id = served_model_name, max_model_len)
    GET  /v1/models/{model}       one model card, or 404 naming the model
    POST /v1/chat/completions     one stateless chat turn (image parts, as SGLang takes them, for a
                                  vision-language model: inline base64 or data: URLs)

A chat turn renders the request's messages (and tools) through the model's chat template once,
generates exactly as /generate would on those ids (same scheduler, sampling and stop handling, so
greedy text is /generate's), and splits the reply into `content` and `tool_calls` with the engine's
`tool_call_parser` when the request offers tools. `stream: true` sends OpenAI stream chunks as the
tokens are sampled (content token by token, each tool call once its block closes; TurnStream). Every
bound is the engine's own (engine_api/parsing.py): a refusal is SGLang's error object
`{"object": "error", "message", "type", "param", "code"}` with status 400 and the field named.
Non-goals: the legacy /v1/completions, n > 1, logprobs in the answer (/generate with return_logprob
has them), exact tokens across the turns of one conversation (the session API, rollout/sessions/,
records those).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from miles.engine_api.chat_completion import SSE_DONE, Completion, RequestRefused, TurnStream, completion_body, \
    parse_request, render_prompt, sse_event, tools_of
from miles.engine_api import bodies, parsing
from miles.engine_api.errors import EngineStepFailed, InvalidRequest, RequestFailed
from miles.engine.streaming import TokenDelta, stream
from miles.engine_api.chat_schema import ChatCompletionRequest
from miles.engine_api.tool_calls import ParsedTurn, get_tool_parser

# What a refused field means here (pydantic's own words say what it expected).
HINTS = {
    "n": "send the request n times; one request is one reply",
    "logprobs": "POST /generate with return_logprob = true returns every token's logprob",
    "logit_bias": "the built-in engine does not bias logits",
    "presence_penalty": "the built-in engine applies no penalties",
    "frequency_penalty": "the built-in engine applies no penalties",
    "response_format": "constrained (JSON) decoding is not supported; ask for JSON in the prompt",
}
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}  # the engine's finish type → OpenAI's
# The engine's field names, as a chat request names them.
_FIELDS = {"sampling_params.max_new_tokens": "max_tokens", "sampling_params.sampling_seed": "seed",
           "sampling_params.": "", "input_ids": "messages"}


def error(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    """SGLang's error object (its ErrorResponse) for a refused OpenAI request."""
    kind = "BadRequestError" if status == 400 else "NotFoundError" if status == 404 else "InternalServerError"
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": param, "code": status},
                        status_code=status)


def _chat_field(message: str) -> str:
    for engine_name, chat_name in _FIELDS.items():
        if message.startswith(engine_name):
            return chat_name + message[len(engine_name):]
    return message


def add_openai_routes(app: FastAPI, engine, served_model_name: str) -> None:
    """Serve /v1/models and /v1/chat/completions on `app` for `engine`."""
    parser = get_tool_parser(engine.config.tool_call_parser)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "miles", "root": name,
                "parent": None, "max_model_len": engine.context_length}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [card(served_model_name)]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if model != served_model_name:
            return error(f"model: {model!r} is not served here; GET /v1/models lists {served_model_name!r}",
                         "model", 404)
        return card(model)

    def checked(raw: bytes):
        """The typed request, its prompt ids and the engine request; refusals name the chat field."""
        req = parse_request(parsing.parse_json(raw), ChatCompletionRequest, HINTS)
        if req.stream_options is not None and not req.stream:
            raise RequestRefused("stream_options: only with stream = true", param="stream_options")
        ids = render_prompt(engine.tokenizer, req.messages, tools_of(req))
        sp = {"temperature": 1.0 if req.temperature is None else req.temperature,
              "top_p": 1.0 if req.top_p is None else req.top_p,
              "max_new_tokens": req.max_completion_tokens or req.max_tokens, "stop": req.stop,
              "sampling_seed": req.seed}
        params = parsing.parse_sampling_params({k: v for k, v in sp.items() if v is not None},
                                                engine.config.default_max_new_tokens)
        images = [url for m in req.messages for url in m.images()]  # SGLang's image parts, in prompt order
        return req, ids, engine.make_request(ids, params, image_data=images)

    @app.post("/v1/chat/completions", openapi_extra=bodies.openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        try:
            # Parsing, rendering and tokenizing cost in proportion to the body: on a thread.
            req, ids, engine_req = await asyncio.to_thread(checked, await request.body())
        except RequestRefused as exc:
            return error(str(exc), exc.param, exc.status)
        except InvalidRequest as exc:
            message = _chat_field(str(exc))
            return error(message, message.split(":", 1)[0] if ":" in message else None)
        model = req.model or served_model_name
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tools_parser = parser if req.tools and req.tool_choice != "none" else None

        def call_id(j: int) -> str:
            return f"call_{engine_req.rid}_{j}"

        def turn_of(result) -> Completion:
            parsed = tools_parser.parse(result.text) if tools_parser is not None else ParsedTurn(result.text)
            calls = [{"id": call_id(j), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for j, c in enumerate(parsed.calls)]
            finish = "tool_calls" if calls else _FINISH.get(result.finish_reason.type, "stop")
            return Completion(cid, created, parsed.content, calls, finish, list(result.output_ids), len(ids))

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_chunks(engine, engine_req, TurnStream(
                cid, created, model, lambda out: engine.tokenizer.decode(
                    out, skip_special_tokens=engine_req.params.skip_special_tokens),
                tools_parser, call_id, max((len(x) for x in engine_req.params.stop), default=0)),
                turn_of, include_usage), media_type="text/event-stream")
        try:
            result = await asyncio.wrap_future(engine.submit(engine_req))
        except asyncio.CancelledError:
            engine.abort(engine_req.rid)  # the client went away: free the batch slot
            raise
        return completion_body(turn_of(result), model)


async def _chunks(engine, engine_req, ts: TurnStream, turn_of, include_usage: bool):
    """The SSE events of a streamed turn, as the engine samples its tokens; a request that fails midway
    ends with an error event (what the openai client raises on)."""
    out: list[int] = []
    try:
        async for item in stream(engine, engine_req):
            if isinstance(item, TokenDelta):
                out += item.ids
                for chunk in ts.feed(out):
                    yield sse_event(chunk)
            else:
                for chunk in ts.finish(turn_of(item), include_usage):
                    yield sse_event(chunk)
    except (RequestFailed, EngineStepFailed) as exc:
        yield sse_event({"error": {"message": str(exc), "type": "InternalServerError", "param": None,
                                   "code": 503 if isinstance(exc, EngineStepFailed) else 422}})
    yield SSE_DONE
