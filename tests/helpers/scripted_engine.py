"""A stand-in for the engine HTTP API's /generate that answers with scripted token ids.

For tests whose subject is what happens to a model's output downstream (tool-call parsing, token
bookkeeping across turns): a tiny random model never writes a `<tool_call>` block or a `<think>`
block on purpose, so the reply's ids are given by the test. Every request body is recorded.
"""

from __future__ import annotations

from fastapi import FastAPI

from miles.net import bind, serve_app


class ScriptedEngine:
    def __init__(self):
        self.replies: list[list[int]] = []   # popped front-first, one per /generate
        self.requests: list[dict] = []
        self.replied: list[list[int]] = []
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {}

        @app.post("/generate")
        async def generate(body: dict):
            self.requests.append(body)
            ids = self.replies.pop(0)
            self.replied.append(ids)
            return {"text": "", "output_ids": ids, "meta_info": {
                "id": body.get("rid"), "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids),
                "finish_reason": {"type": "stop"}, "weight_version": "3",
                "output_token_logprobs": [[-0.25, t, None] for t in ids]}}

        self.http = serve_app(app, bind("127.0.0.1", 0), "127.0.0.1", what="scripted engine", ready_path="/health",
                              startup_timeout_s=30, lifespan="off")
        self.url = self.http.url

    def stop(self) -> None:
        self.http.stop()
