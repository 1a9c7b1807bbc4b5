"""The engine's weight routes: the ones every transport shares, and a mount point for each
transport's own (built from its Receiver in miles/sync/transports/<name>.py).

Shared here:
    POST /update_weights_from_disk    SGLang's {model_path} reloads a safetensors checkpoint; a
         transport may add a load_format of its own (disk_delta: "miles_delta", {model_path: <version
         dir>, commit: false} stages, {commit: true, weight_version} applies), and {reset_staging: true}
         discards whatever is staged.
    POST /weights_checker             {action: snapshot | reset_tensors | compare | checksum}
The transports add, among others: /init_weights_update_group, /update_weights_from_distributed
(broadcast), /update_weights_from_tensor (colocated, p2p), /p2p_open_buffer (p2p), /init_delta_base
(disk_delta). All of them are admin endpoints. A refused update leaves the engine on its previous weights.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import APIRouter, HTTPException, Request

from miles.net import UNAUTHORIZED, bearer_ok
from miles.rollout.engine import protocol
from miles.rollout.engine.types import InvalidRequest

_DISK_FIELDS = {"model_path", "load_format", "commit", "weight_version", "reset_staging", "flush_cache",
                "abort_all_requests"}


class WeightRoutes:
    """The engine's weight router, handed to each transport's Receiver to mount its routes on."""

    def __init__(self, engine, require_admin: Callable[[Request], None]):
        self.router = APIRouter()
        self.engine = engine
        self.weights = engine.receiver
        self.require_admin = require_admin  # the server's own admin check (SGLang's routes answer with it)
        self.disk_formats: dict[str, Callable[[str], str]] = {}  # load_format -> stage(model_path) -> message
        self.post("/update_weights_from_disk", self._from_disk, fields=_DISK_FIELDS)
        self.post("/weights_checker", self._checker, fields={"action", "seed", "expected", "buckets"})
        for part in self.weights.parts.values():
            part.mount(self)

    def post(self, path: str, handler: Callable[[dict], dict], *, fields: set[str] | None = None,
             thread: bool = True, sglang: bool = False) -> None:
        """Serve `handler(body) -> reply` as an admin POST route, off the event loop unless thread=False.
        fields: the body's allowed keys. sglang: SGLang's routes, refused as the server's other admin
        routes are (their bodies are checked by protocol.parse_*)."""

        async def route(request: Request):
            if sglang:
                self.require_admin(request)
            elif not bearer_ok(request.headers.get("authorization"), self.engine.config.admin_token):
                raise HTTPException(401, UNAUTHORIZED)
            body = protocol.parse_json(await request.body())
            if fields is not None:
                protocol.no_unknown(body, fields)
            return await asyncio.to_thread(handler, body) if thread else handler(body)

        self.router.post(path)(route)

    def finish(self, body: dict, staged_msg: str) -> dict:
        """Commit if asked (the staged version becomes the served one, all at once)."""
        if not self.flag(body, "commit", False):
            return {"success": True, "message": staged_msg}
        if self.flag(body, "abort_all_requests", False):
            self.engine.abort()
        version = self.weights.commit(_version(body.get("weight_version")),
                                      flush_cache=self.flag(body, "flush_cache", True),
                                      swap_buffers=self.flag(body, "swap_buffers", False))
        reply = {"success": True, "message": f"weights updated to version {version}", "weight_version": version}
        if isinstance(body.get("shm_path"), str):
            reply["shm_path"] = self.weights.write_next(body["shm_path"])  # where the next version goes
        return reply

    @staticmethod
    def flag(body: dict, key: str, default: bool) -> bool:
        v = body.get(key, default)
        if not isinstance(v, bool):
            raise InvalidRequest(f"{key}: expected true or false")
        return v

    @staticmethod
    def list(body: dict, key: str) -> list:
        v = body.get(key, [])
        if not isinstance(v, list):
            raise InvalidRequest(f"{key}: expected a list")
        return v

    def _from_disk(self, body: dict) -> dict:
        fmt = body.get("load_format")
        path = body.get("model_path")
        if path is not None and not isinstance(path, str):
            raise InvalidRequest("model_path: expected a directory path")
        receiver = self.weights
        if self.flag(body, "reset_staging", False):
            receiver.reset_staging()
            if path is None and not self.flag(body, "commit", False):
                return {"success": True, "message": "staging discarded"}
        if fmt in self.disk_formats:
            return self.finish(body, "nothing staged" if path is None else self.disk_formats[fmt](path))
        if fmt not in (None, "auto", "safetensors"):
            choices = " or ".join(repr(f) for f in [*self.disk_formats, "safetensors"])
            raise InvalidRequest(f"load_format: {fmt!r} is not supported; use {choices}")
        if path is None:
            raise InvalidRequest("model_path: send the checkpoint directory to load")
        receiver.reset_staging()
        try:
            n = receiver.stage_checkpoint(path)
        except InvalidRequest:
            receiver.reset_staging()
            raise
        # SGLang's contract: a checkpoint load is applied at once.
        return self.finish({**body, "commit": True}, f"loaded {n} tensors")

    def _checker(self, body: dict) -> dict:
        action = body.get("action")
        if not isinstance(action, str):
            raise InvalidRequest("action: send one of snapshot, reset_tensors, compare, checksum")
        return self.weights.check(action, body)


def build_weight_router(engine, require_admin: Callable[[Request], None]) -> APIRouter:
    """Every weight route of the engine: the shared ones and each registered transport's."""
    return WeightRoutes(engine, require_admin).router


def _version(v) -> int | None:
    if isinstance(v, str) and v.isdigit():  # SGLang sends versions as strings
        v = int(v)
    if v is not None and (type(v) is not int or v < 0):
        raise InvalidRequest("weight_version: expected a non-negative integer")
    return v
