"""The engine's weight endpoints beyond the distributed group (which server.py serves itself).

    POST /update_weights_from_tensor  {load_format: "shm", shm_path, names, dtypes, shapes, offsets,
                                       commit, weight_version, reset_staging, flush_cache}
         stage a bucket from a shared-memory buffer on this host (p2p, colocated); commit=true with no
         names applies everything staged. With swap_buffers=true a whole version in an own p2p buffer
         becomes the parameters' memory, and the reply's shm_path is where the next version must go.
    POST /update_weights_from_disk    SGLang's {model_path} reloads a safetensors checkpoint; miles'
         {load_format: "miles_delta", model_path: <version dir>, commit: false} patches the local copy
         and stages it, {load_format: "miles_delta", commit: true, weight_version} applies it, and
         {reset_staging: true} discards whatever is staged.
    POST /init_delta_base             {base_path, local_dir, base_version}: local copy for disk deltas.
    POST /p2p_open_buffer {nbytes} -> {shm_path};  POST /p2p_close_buffer {shm_path}
    POST /weights_checker             {action: snapshot | reset_tensors | compare | checksum}
All of them are admin endpoints. A refused update leaves the engine on its previous weights.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, HTTPException, Request

from miles.rollout.engine import protocol
from miles.rollout.engine.types import InvalidRequest

_TENSOR_FIELDS = {"load_format", "shm_path", "names", "dtypes", "shapes", "offsets", "commit", "weight_version",
                  "reset_staging", "flush_cache", "abort_all_requests", "serialized_named_tensors", "swap_buffers"}
_DISK_FIELDS = {"model_path", "load_format", "commit", "weight_version", "reset_staging", "flush_cache",
                "abort_all_requests"}


def build_weight_router(engine) -> APIRouter:
    router = APIRouter()
    receiver = engine.receiver

    async def admin_body(request: Request) -> dict:
        token = engine.config.admin_token
        if token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise HTTPException(401, "admin endpoint: send header 'Authorization: Bearer <admin token>'")
        body = protocol.parse_json(await request.body())
        if not isinstance(body, dict):
            raise InvalidRequest("body: expected a JSON object")
        return body

    def finish(body: dict, staged_msg: str) -> dict:
        """Commit if asked (the staged version becomes the served one, all at once)."""
        if not _flag(body, "commit", False):
            return {"success": True, "message": staged_msg}
        if _flag(body, "abort_all_requests", False):
            engine.abort()
        version = receiver.commit(_version(body.get("weight_version")), flush_cache=_flag(body, "flush_cache", True),
                                  swap_buffers=_flag(body, "swap_buffers", False))
        reply = {"success": True, "message": f"weights updated to version {version}", "weight_version": version}
        if isinstance(body.get("shm_path"), str):
            reply["shm_path"] = receiver.write_next(body["shm_path"])  # where the next version goes
        return reply

    @router.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await admin_body(request)
        _known(body, _TENSOR_FIELDS)
        if "serialized_named_tensors" in body:
            raise InvalidRequest("serialized_named_tensors: pickled tensors are not accepted (unpickling runs "
                                 "code); send load_format 'shm' with shm_path and the bucket layout")
        fmt = body.get("load_format", "shm")
        if fmt != "shm":
            raise InvalidRequest(f"load_format: {fmt!r} is not supported; use 'shm'")
        names = _list(body, "names")

        def work() -> dict:
            if _flag(body, "reset_staging", False):
                receiver.reset_staging()
            if names:
                path = body.get("shm_path")
                if not isinstance(path, str):
                    raise InvalidRequest("shm_path: send the path of the shared-memory buffer holding the bucket")
                try:
                    receiver.receive_shm(path, names, _list(body, "dtypes"), _list(body, "shapes"),
                                         _list(body, "offsets"))
                except InvalidRequest:
                    if _flag(body, "commit", False):
                        receiver.reset_staging()
                    raise
            return finish(body, f"staged {len(names)} tensors")

        return await asyncio.to_thread(work)

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await admin_body(request)
        _known(body, _DISK_FIELDS)
        fmt = body.get("load_format")
        path = body.get("model_path")
        if path is not None and not isinstance(path, str):
            raise InvalidRequest("model_path: expected a directory path")

        def work() -> dict:
            if _flag(body, "reset_staging", False):
                receiver.reset_staging()
                if path is None and not _flag(body, "commit", False):
                    return {"success": True, "message": "staging discarded"}
            if fmt == "miles_delta":
                msg = "nothing staged"
                if path is not None:
                    version = receiver.stage_delta(path)
                    msg = f"delta to version {version} verified and staged"
                return finish(body, msg)
            if fmt not in (None, "auto", "safetensors"):
                raise InvalidRequest(f"load_format: {fmt!r} is not supported; use 'miles_delta' or 'safetensors'")
            if path is None:
                raise InvalidRequest("model_path: send the checkpoint directory to load")
            receiver.reset_staging()
            try:
                n = receiver.stage_checkpoint(path)
            except InvalidRequest:
                receiver.reset_staging()
                raise
            # SGLang's contract: a checkpoint load is applied at once.
            return finish({**body, "commit": True}, f"loaded {n} tensors")

        return await asyncio.to_thread(work)

    @router.post("/init_delta_base")
    async def init_delta_base(request: Request):
        body = await admin_body(request)
        _known(body, {"base_path", "local_dir", "base_version"})
        base, local = body.get("base_path"), body.get("local_dir")
        if not isinstance(base, str) or not isinstance(local, str):
            raise InvalidRequest("base_path and local_dir: send the run's starting checkpoint and this host's dir")
        base_version = body.get("base_version", 0)
        if type(base_version) is not int or base_version < 0:
            raise InvalidRequest("base_version: expected a non-negative integer")

        def work():
            from miles.sync.transports.disk_delta import DeltaError

            try:
                return receiver.init_delta_base(base, local, base_version)
            except (DeltaError, OSError) as exc:
                raise InvalidRequest(f"base_path: {exc}") from None

        return {"success": True, "message": await asyncio.to_thread(work)}

    @router.post("/p2p_open_buffer")
    async def p2p_open_buffer(request: Request):
        body = await admin_body(request)
        _known(body, {"nbytes"})
        nbytes = body.get("nbytes")
        if type(nbytes) is not int or not 0 < nbytes <= 1 << 40:
            raise InvalidRequest("nbytes: expected a positive integer (the largest bucket in bytes)")
        return {"success": True, "shm_path": await asyncio.to_thread(receiver.open_p2p_buffer, nbytes)}

    @router.post("/p2p_close_buffer")
    async def p2p_close_buffer(request: Request):
        body = await admin_body(request)
        _known(body, {"shm_path"})
        receiver.close_p2p_buffer(str(body.get("shm_path")))
        return {"success": True}

    @router.post("/weights_checker")
    async def weights_checker(request: Request):
        body = await admin_body(request)
        _known(body, {"action", "seed", "expected", "buckets"})
        action = body.get("action")
        if not isinstance(action, str):
            raise InvalidRequest("action: send one of snapshot, reset_tensors, compare, checksum")
        return await asyncio.to_thread(receiver.check, action, body)

    return router


def _known(body: dict, fields: set[str]) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise InvalidRequest(f"{unknown[0]}: unknown field; supported fields are {sorted(fields)}")


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise InvalidRequest(f"{key}: expected true or false")
    return v


def _list(body: dict, key: str) -> list:
    v = body.get(key, [])
    if not isinstance(v, list):
        raise InvalidRequest(f"{key}: expected a list")
    return v


def _version(v) -> int | None:
    if isinstance(v, str) and v.isdigit():  # SGLang sends versions as strings
        v = int(v)
    if v is not None and (type(v) is not int or v < 0):
        raise InvalidRequest("weight_version: expected a non-negative integer")
    return v
