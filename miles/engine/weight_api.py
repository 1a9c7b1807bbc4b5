"""The engine's weight routes: the ones every transport shares, and a mount point for each
transport's own (built from its Receiver in miles/sync/transports/<name>.py).

Shared here (SGLang's routes, bodies as SGLang declares them, see engine_api/bodies.py):
    POST /update_weights_from_disk    {model_path, weight_version, flush_cache, ...} reloads a
         safetensors checkpoint and applies it. With the `staged_commit` extension a transport may add a
         load_format of its own (disk_delta: "miles_delta", {model_path: <version dir>, commit: false}
         stages, {commit: true, weight_version} applies), and {reset_staging: true} discards staging.
    POST /update_weight_version       {new_version} relabels the weights in force.
    POST /begin_weight_update {selector}, POST /end_weight_update: SGLang's weight-update session. In
         SGLang-only mode /update_weights_from_distributed and /update_weights_from_tensor are refused
         outside one, as SGLang 0.5.23 refuses them (miles' staged commit needs no session).
    GET|POST /weights_checker         {action: snapshot | reset_tensors | compare | checksum}; the
         `checked_weights` extension adds a noise seed, an expected checksum table, bucket checksums
         and action begin_session. reset_tensors is refused outside a verification session (opened by
         snapshot or begin_session, closed by compare), and generation is held from the noise fill
         until a compare vouches for the weights.
The transports add, among others: /init_weights_update_group, /update_weights_from_distributed
(broadcast), /update_weights_from_tensor (colocated, p2p), /p2p_open_buffer (p2p), /init_delta_base
(disk_delta). All of them are admin endpoints. A refused update leaves the engine on its previous
weights and answers HTTP 400 {success: false, message}, as SGLang does, and keeps nothing it staged.
A commit needs something staged and a version no older than the one in force (miles.versions.never_backwards).
In SGLang-only mode (EngineConfig.sglang_only) only SGLang's routes and fields are served.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import APIRouter, HTTPException, Request

from miles.engine_api import bodies, parsing
from miles.engine_api.errors import InvalidRequest
from miles.engine_api.extensions import BASE_EXTENSIONS
from miles.net import UNAUTHORIZED, bearer_ok


# SGLang's routes that load weights only inside a weight-update session (its scheduler's weight_updater.py).
SESSION_ROUTES = ("/update_weights_from_distributed", "/update_weights_from_tensor")


class WeightRoutes:
    """The engine's weight router, handed to each transport's Receiver to mount its routes on."""

    def __init__(self, engine, require_admin: Callable[[Request], None]):
        self.router = APIRouter()
        self.engine = engine
        self.weights = engine.receiver
        self.require_admin = require_admin  # the server's own admin check (SGLang's routes answer with it)
        self.sglang_only = engine.config.sglang_only
        self.disk_formats: dict[str, Callable[[str], str]] = {}  # load_format -> stage(model_path) -> message
        self.post("/update_weights_from_disk", self._from_disk, sglang=True, stages=True)
        self.post("/update_weight_version", self._relabel, sglang=True)
        self.post("/weights_checker", self._checker, sglang=True, methods=["GET", "POST"])
        self.session_open = False  # between /begin_weight_update and /end_weight_update
        self.post("/begin_weight_update", self._begin_session, sglang=True, thread=False)
        self.post("/end_weight_update", self._end_session, sglang=True, thread=False)
        for part in self.weights.parts.values():
            part.mount(self)

    def extensions(self) -> list[str]:
        """The miles extensions this engine offers (none in SGLang-only mode)."""
        if self.sglang_only:
            return []
        quantized = ["quantized_weights"] if getattr(self.engine, "quantized", None) else []
        return [*BASE_EXTENSIONS, *quantized, *(p.extension for p in self.weights.parts.values() if p.extension)]

    def parse(self, sglang_model, miles_model, body: dict):
        """The body as SGLang's model, or with the miles extension's fields unless in SGLang-only mode."""
        return bodies.parse_body(sglang_model if self.sglang_only else miles_model, body)

    def post(self, path: str, handler: Callable[[dict], dict], *, fields: set[str] | None = None,
             thread: bool = True, sglang: bool = False, methods: list[str] | None = None,
             stages: bool = False) -> None:
        """Serve `handler(body) -> reply` as an admin POST route, off the event loop unless thread=False.
        fields: the body's allowed keys. sglang: SGLang's routes, refused as the server's other admin
        routes are (their bodies are checked by bodies.parse_*). stages: the route puts weights into
        staging, so a refusal of it discards staging (and poisons a version sent in several requests)."""

        async def route(request: Request):
            if sglang:
                self.require_admin(request)
            elif not bearer_ok(request.headers.get("authorization"), self.engine.config.admin_token):
                raise HTTPException(401, UNAUTHORIZED)
            raw = await request.body()
            body = parsing.parse_json(raw) if raw.strip() else {}  # SGLang's GET forms send no body
            try:
                if self.sglang_only and path in SESSION_ROUTES and not self.session_open:
                    raise InvalidRequest(f"{path.lstrip('/')} must run between begin_weight_update() and "
                                         "end_weight_update()")  # SGLang's own words
                if fields is not None:
                    parsing.no_unknown(body, fields)
                return await asyncio.to_thread(handler, body) if thread else handler(body)
            except InvalidRequest as exc:
                if stages:  # all or nothing: a refused update leaves nothing a later commit could apply
                    await asyncio.to_thread(self.weights.refused, str(exc), body.get("commit") is False)
                raise

        self.router.add_api_route(path, route, methods=methods or ["POST"])

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
        req = self.parse(bodies.UpdateWeightFromDisk, bodies.MilesUpdateWeightFromDisk, body)
        fmt, path = req.load_format, req.model_path
        receiver = self.weights
        if getattr(req, "reset_staging", False):
            receiver.reset_staging()
            if path is None and not req.commit:
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
        reply = self.finish({**body, "commit": True}, f"loaded {n} tensors")
        return {**reply, "num_paused_requests": 0}

    def _relabel(self, body: dict) -> dict:
        req = bodies.parse_body(bodies.UpdateWeightVersion, body)
        if req.abort_all_requests:
            self.engine.abort()
        self.engine.set_weight_version(req.new_version)
        return {"success": True, "message": f"Weight version updated to {req.new_version}",
                "new_version": req.new_version}

    def _begin_session(self, body: dict) -> dict:
        bodies.parse_body(bodies.BeginWeightUpdate, body)
        if self.session_open:
            raise InvalidRequest("a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        return {"success": True, "message": "Success"}

    def _end_session(self, body: dict) -> dict:
        bodies.parse_body(bodies.EndWeightUpdate, body)
        if not self.session_open:
            raise InvalidRequest("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return {"success": True, "message": "Success"}

    def _checker(self, body: dict) -> dict:
        return self.weights.check(self.parse(bodies.CheckWeights, bodies.MilesCheckWeights, body))


def build_weight_router(engine, require_admin: Callable[[Request], None]) -> APIRouter:
    """Every weight route of the engine: the shared ones and each registered transport's."""
    return WeightRoutes(engine, require_admin).router


def _version(v) -> str | None:
    if v is not None and not isinstance(v, str):
        raise InvalidRequest(f"weight_version: expected a string (SGLang's versions are strings), got {v!r}")
    return v
