"""A stand-in for the engine HTTP API's /generate that answers with scripted token ids.

For tests whose subject is what happens to a model's output downstream (tool-call parsing, token
bookkeeping across turns): a tiny random model never writes a `<tool_call>` block or a `<think>`
block on purpose, so the reply's ids are given by the test. Every request body is recorded.
With `stream: true` it answers as SGLang streams: one chunk per token, each holding every id so far
(or only the new one with `incremental = True`), and it can hold a stream midway (`hold_after`
tokens, until `release` is set) so a test can see what a client got before the turn ended.
"""

from __future__ import annotations

import asyncio
import json
import threading

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from miles.net import bind, serve_app


class ScriptedEngine:
    def __init__(self):
        self.replies: list[list[int]] = []   # popped front-first, one per /generate
        self.requests: list[dict] = []
        self.replied: list[list[int]] = []
        self.incremental = False
        self.hold_after: int | None = None   # a stream waits for `release` after this many tokens
        self.release = threading.Event()
        self.streamed_to: list[int] = []     # per streamed request: tokens sent so far
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {}

        @app.post("/generate")
        async def generate(body: dict):
            self.requests.append(body)
            ids = self.replies.pop(0)
            self.replied.append(ids)
            if body.get("stream"):
                return StreamingResponse(self._chunks(body, ids), media_type="text/event-stream")
            return self._answer(body, ids, ids, {"type": "stop"})

        self.http = serve_app(app, bind("127.0.0.1", 0), "127.0.0.1", what="scripted engine", ready_path="/health",
                              startup_timeout_s=30, lifespan="off")
        self.url = self.http.url

    def _answer(self, body: dict, sent: list[int], so_far: list[int], finish) -> dict:
        return {"text": "", "output_ids": sent, "meta_info": {
            "id": body.get("rid"), "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(so_far),
            "finish_reason": finish, "weight_version": "3",
            "output_token_logprobs": [[-0.25, t, None] for t in sent]}}

    async def _chunks(self, body: dict, ids: list[int]):
        k = len(self.streamed_to)
        self.streamed_to.append(0)
        for i in range(1, len(ids) + 1):
            if self.hold_after is not None and i == self.hold_after + 1:
                await asyncio.to_thread(self.release.wait, 30)
            sent = ids[i - 1:i] if self.incremental else ids[:i]
            finish = {"type": "stop"} if i == len(ids) else None
            yield f"data: {json.dumps(self._answer(body, sent, ids[:i], finish))}\n\n"
            self.streamed_to[k] = i
        yield "data: [DONE]\n\n"

    def stop(self) -> None:
        self.http.stop()
