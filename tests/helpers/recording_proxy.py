"""A recording HTTP proxy: forwards every request to one upstream server unchanged and keeps what
was sent (method, path, query, JSON body), so a test can check exactly what a client said on the wire."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from miles.net import bind, serve_app


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: str
    body: object  # the parsed JSON body; None when the request had none


class RecordingProxy:
    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        app = FastAPI()
        client = httpx.AsyncClient(timeout=None)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def forward(path: str, request: Request):
            raw = await request.body()
            with self._lock:
                self.requests.append(Recorded(request.method, "/" + path, request.url.query,
                                              json.loads(raw) if raw.strip() else None))
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            url = f"{self.upstream}/{path}" + (f"?{request.url.query}" if request.url.query else "")
            r = await client.request(request.method, url, content=raw, headers=headers)
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

        self._http = serve_app(app, bind("127.0.0.1", 0), "127.0.0.1", what="recording proxy", ready_path="/health",
                               startup_timeout_s=30, log_level="error", lifespan="off")
        self.url = self._http.url

    def stop(self) -> None:
        self._http.stop()
