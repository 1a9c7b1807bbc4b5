"""Colocated transport: trainer and engines share this machine and take turns.

Nothing is serialised: the trainer copies each bucket once into a shared-memory buffer it owns and
hands the engines a handle (the buffer's path and each tensor's offset, dtype and shape); every
engine maps the same pages and copies the bytes into its staging. Engines apply at commit, all at once.
The engine's end (Receiver) serves SGLang's /update_weights_from_tensor with load_format "shm": it
stages a bucket out of a shared-memory buffer on this host, the trainer's (copied out, since the
trainer reuses it) or one the engine lent a p2p sender (staged in place, see p2p.py).
Non-goals: zero-copy into the engine's parameters (the buffer is reused for the next bucket, so
the engine must take its copy before the trainer moves on), CUDA IPC handles (a GPU build).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from miles.engine_api.client import EngineClient
from miles.net import LOOPBACK
from miles.sync import shm
from miles.sync.prepare import SyncConfig
from miles.sync.transports.base import TransportError, TransportReceiver, WeightUpdateError, reconnect
from miles.sync.transports.p2p import is_local
from miles.versions import to_wire

if TYPE_CHECKING:
    import torch


class ColocatedTransport:
    """The sender: owns the shared-memory buffer each bucket is copied into once."""

    Config = SyncConfig  # the buffer starts at sync.bucket_size_mb
    supports_colocation = supports_lora = supports_pd_disaggregation = True

    def __init__(self, admin_token: str | None = None, timeout_s: float = 120.0, buffer_bytes: int = 64 << 20,
                 node_address: str = LOOPBACK):
        self.admin_token, self.timeout_s, self.buffer_bytes = admin_token, timeout_s, buffer_bytes
        self.node_address = node_address  # the trainer's node: engines must share it
        self.engine_urls: list[str] = []
        self._client: EngineClient | None = None
        self._path: str | None = None
        self._buf = None
        self._fresh = True
        self._failed: str | None = None

    @classmethod
    def from_config(cls, cfg: SyncConfig, admin_token: str | None, base_path: str = "") -> ColocatedTransport:
        return cls(admin_token=admin_token, timeout_s=cfg.timeout_s, buffer_bytes=cfg.buffer_bytes,
                   node_address=cfg.master_address or LOOPBACK)

    def connect(self, engine_urls: list[str]) -> None:
        far = [u for u in engine_urls if not is_local(u, self.node_address)]
        if far:
            raise TransportError(f"colocated transport: engine(s) {far} are not on the trainer's node "
                                 f"({self.node_address}); use sync.transport = 'p2p' or 'broadcast' for engines "
                                 "on other nodes")
        self._client = reconnect(self, engine_urls, self.timeout_s)
        self._path, self._buf = shm.create(self.buffer_bytes, tag="colo")
        self._fresh, self._failed = True, None

    def send_bucket(self, bucket: list[tuple[str, "torch.Tensor"]]) -> None:
        if self._client is None:
            raise TransportError("colocated transport is not connected: call connect(engine_urls) first")
        if not bucket:
            return
        offsets, nbytes = shm.layout(bucket)
        if self._buf.numel() < nbytes:
            shm.unlink(self._path)
            self._path, self._buf = shm.create(nbytes, tag="colo")
        shm.write_bucket(self._buf, bucket, offsets)
        body = {**shm.bucket_meta(bucket, offsets), "load_format": "shm", "shm_path": self._path, "commit": False,
                "reset_staging": self._fresh}
        self._fresh = False
        try:
            self._client.post_all(self.engine_urls, "/update_weights_from_tensor", body)
        except TransportError as exc:
            self._failed = str(exc)
            raise

    def commit(self, weight_version: int) -> None:
        if self._client is None:
            raise TransportError("colocated transport is not connected: call connect(engine_urls) first")
        self._fresh = True
        if self._failed is not None:
            why, self._failed = self._failed, None
            try:
                self._client.post_all(self.engine_urls, "/update_weights_from_tensor",
                                      {"names": [], "reset_staging": True, "commit": False, "load_format": "shm"})
            except TransportError:
                pass
            raise TransportError(f"not committing weight version {weight_version}: a bucket of it failed ({why}); "
                                 "engines keep their previous weights")
        self._client.post_all(self.engine_urls, "/update_weights_from_tensor",
                              {"names": [], "load_format": "shm", "commit": True,
                               "weight_version": to_wire(weight_version)})

    def close(self) -> None:
        if self._path is not None:
            shm.unlink(self._path)
        self._path = self._buf = None
        if self._client is not None:
            self._client.close()
        self._client = None


# ---- engine side ----------------------------------------------------------------------------------

_TENSOR_FIELDS = {"load_format", "shm_path", "names", "dtypes", "shapes", "offsets", "commit", "weight_version",
                  "reset_staging", "flush_cache", "abort_all_requests", "serialized_named_tensors", "swap_buffers",
                  "screened"}


class ColocatedReceiver(TransportReceiver):
    """The engine's end: stage buckets out of shared memory on this host (/update_weights_from_tensor)."""

    extension = "colocated"

    def __init__(self, weights):
        super().__init__(weights)
        # Mappings of senders' buffers, most recent last: mapping anew for every bucket would fault
        # in every page again. Bounded, since a sender's unlinked buffer stays mapped here.
        self._foreign: dict[str, "torch.Tensor"] = {}

    def mount(self, api) -> None:
        api.post("/update_weights_from_tensor", lambda body: self._route(api, body), fields=_TENSOR_FIELDS,
                 stages=True)

    def _route(self, api, body: dict) -> dict:
        if "serialized_named_tensors" in body:
            raise WeightUpdateError("serialized_named_tensors: pickled tensors are not accepted (unpickling runs "
                                    "code); send load_format 'shm' with shm_path and the bucket layout")
        fmt = body.get("load_format", "shm")
        if fmt != "shm":
            raise WeightUpdateError(f"load_format: {fmt!r} is not supported; use 'shm'")
        names = api.list(body, "names")
        if api.flag(body, "reset_staging", False):
            self.weights.reset_staging()
        if names:
            path = body.get("shm_path")
            if not isinstance(path, str):
                raise WeightUpdateError("shm_path: send the path of the shared-memory buffer holding the bucket")
            try:
                self.receive_shm(path, names, api.list(body, "dtypes"), api.list(body, "shapes"),
                                 api.list(body, "offsets"), screened=api.flag(body, "screened", False))
            except WeightUpdateError:
                if api.flag(body, "commit", False):
                    self.weights.reset_staging()
                raise
        return api.finish(body, f"staged {len(names)} tensors")

    def receive_shm(self, path: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    offsets: list[int], screened: bool = False) -> None:
        """Stage one bucket from a shared-memory buffer (one this engine lent, or a sender's).
        screened: the sender found no NaN/Inf in the bytes it wrote into a buffer this engine lent it,
        so they are not read again here (a buffer someone else owns is always screened)."""
        import torch

        if not names:
            return
        w = self.weights
        with w.lock:
            if not len(names) == len(dtypes) == len(shapes) == len(offsets):
                raise w.fail(f"names, dtypes, shapes and offsets must have equal lengths, got {len(names)}, "
                             f"{len(dtypes)}, {len(shapes)}, {len(offsets)}")
            specs = w.specs(names, dtypes, shapes)
            if any(type(o) is not int or o < 0 for o in offsets):
                raise w.fail("offsets: expected non-negative integers")
            ends = [off + math.prod(s) * torch.empty((), dtype=dt).element_size()
                    for off, (_, dt, s) in zip(offsets, specs)]
            buf = w.lent(path)
            own = buf is not None
            try:
                if buf is None:
                    buf = self._foreign.pop(path, None)
                    if buf is None or buf.numel() < max(ends):
                        buf = shm.attach(path, max(ends))
                    self._foreign[path] = buf
                    while len(self._foreign) > 2:
                        self._foreign.pop(next(iter(self._foreign)))
                elif buf.numel() < max(ends):
                    raise ValueError(f"the bucket needs {max(ends)} bytes but buffer {path} holds {buf.numel()}")
            except ValueError as exc:
                raise w.fail(f"shm_path: {exc}") from None
            received = {}
            for (name, dtype, shape), off, end in zip(specs, offsets, ends):
                # A buffer this engine lent holds a whole version (each bucket at its own offset,
                # rewritten only by the next version, after commit has copied it out), so it IS the
                # staging; a buffer someone else owns is reused for their next bucket: copy out.
                chunk = buf[off:end] if own else w.buffer(end - off).copy_(buf[off:end])
                received[name] = chunk.view(dtype).reshape(shape)
            del buf
            # Only the sender writes into a lent buffer, and it screened every byte as it wrote them.
            err = w.validate(received, set() if screened and own else None)
            if err is not None:
                raise w.fail(err)
            w.stage(received, owned=not own, lent=path if own else None)


ColocatedTransport.Receiver = ColocatedReceiver  # the engine's end, defined after the sender it answers
