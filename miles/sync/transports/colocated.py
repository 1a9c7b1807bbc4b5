"""Colocated transport: trainer and engines share this machine and take turns.

Nothing is serialised: the trainer copies each bucket once into a shared-memory buffer it owns and
hands the engines a handle (the buffer's path and each tensor's offset, dtype and shape); every
engine maps the same pages and copies the bytes into its staging. Engines apply at commit, all at once.
On one GPU (a cuda trainer and cuda engines on the same card, as /get_server_info's `gpu_uuid` says)
the buffer is device memory and the handle a CUDA IPC handle (cuda_ipc.py): weights go from the
trainer's GPU memory to the engine's without touching the host, and the engine adopts its staged
copy as its parameters at commit.
The engine's end (Receiver) serves SGLang's /update_weights_from_tensor with load_format "shm": it
stages a bucket out of a shared-memory buffer on this host, the trainer's (copied out, since the
trainer reuses it) or one the engine lent a p2p sender (staged in place, see p2p.py).
Non-goals: zero-copy into the engine's parameters (the buffer is reused for the next bucket, so
the engine must take its copy before the trainer moves on), handles across GPUs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from miles.devices import gpu_uuid
from miles.engine_api.client import EngineClient
from miles.net import LOOPBACK
from miles.sync import cuda_ipc, shm
from miles.sync.prepare import SyncConfig
from miles.sync.transports.base import TransportError, TransportReceiver, WeightUpdateError, reconnect
from miles.versions import to_wire
from miles.sync.transports.p2p import is_local

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
        self._gpu: str | None = None  # the GPU (uuid) every engine computes on, when all share one
        self._device_buf = None  # (bytes,) uint8 on that GPU, shared with the engines by CUDA IPC
        self._handle: dict | None = None

    @property
    def takes_device_tensors(self) -> bool:
        """Whether the trainer should hand over tensors on its GPU (every engine shares it) rather than
        copy them to the host first."""
        return self._gpu is not None

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
        self._gpu = self._shared_gpu(engine_urls)

    def _shared_gpu(self, urls: list[str]) -> str | None:
        """The uuid of the GPU this process and every engine compute on, or None (then: host memory)."""
        import torch

        if not torch.cuda.is_available():
            return None
        mine = gpu_uuid(torch.cuda.current_device())
        infos = [self._client.get(u, "/get_server_info") for u in urls]
        return mine if all(i.get("gpu_uuid") == mine for i in infos) else None

    def send_bucket(self, bucket: list[tuple[str, "torch.Tensor"]]) -> None:
        if self._client is None:
            raise TransportError("colocated transport is not connected: call connect(engine_urls) first")
        if not bucket:
            return
        offsets, nbytes = shm.layout(bucket)
        if self._gpu is not None and bucket[0][1].is_cuda:
            return self._send(bucket, offsets, {**self._device_bucket(bucket, offsets, nbytes),
                                                "load_format": "cuda_ipc"})
        if self._buf.numel() < nbytes:
            shm.unlink(self._path)
            self._path, self._buf = shm.create(nbytes, tag="colo")
        shm.write_bucket(self._buf, bucket, offsets)
        self._send(bucket, offsets, {"load_format": "shm", "shm_path": self._path})

    def _device_bucket(self, bucket, offsets: list[int], nbytes: int) -> dict:
        """Copy the bucket into the device buffer (grown when too small); the IPC handle to it."""
        import torch

        device = bucket[0][1].device
        if self._device_buf is None or self._device_buf.numel() < nbytes:
            self._device_buf = self._handle = None  # the old buffer is freed before the larger one is taken
            self._device_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._handle = cuda_ipc.share(self._device_buf)
        shm.write_bucket(self._device_buf, bucket, offsets)
        torch.cuda.synchronize(device)  # the engines read it from their own processes and streams
        return {"ipc_handle": self._handle}

    def _send(self, bucket, offsets: list[int], where: dict) -> None:
        body = {**shm.bucket_meta(bucket, offsets), **where, "commit": False,
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
        self._device_buf = self._handle = None
        if self._client is not None:
            self._client.close()
        self._client = None


# ---- engine side ----------------------------------------------------------------------------------

_TENSOR_FIELDS = {"load_format", "shm_path", "names", "dtypes", "shapes", "offsets", "commit", "weight_version",
                  "reset_staging", "flush_cache", "abort_all_requests", "serialized_named_tensors", "swap_buffers",
                  "screened", "ipc_handle"}


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
        if fmt not in ("shm", "cuda_ipc"):
            raise WeightUpdateError(f"load_format: {fmt!r} is not supported; use 'shm' (or 'cuda_ipc' on a GPU)")
        names = api.list(body, "names")
        if api.flag(body, "reset_staging", False):
            self.weights.reset_staging()
        if not names:
            return api.finish(body, "staged 0 tensors")
        layout = (names, api.list(body, "dtypes"), api.list(body, "shapes"), api.list(body, "offsets"))
        path = body.get("shm_path")
        if fmt == "shm" and not isinstance(path, str):
            raise WeightUpdateError("shm_path: send the path of the shared-memory buffer holding the bucket")
        try:
            if fmt == "cuda_ipc":
                self.receive_ipc(body.get("ipc_handle"), *layout)
            else:
                self.receive_shm(path, *layout, screened=api.flag(body, "screened", False))
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
        if not names:
            return
        w = self.weights
        with w.lock:
            specs, ends = _bucket_layout(w, names, dtypes, shapes, offsets)
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

    def receive_ipc(self, handle, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    offsets: list[int]) -> None:
        """Stage one bucket out of the sender's device buffer: copied into staging on this engine's GPU
        (owned, so commit adopts it as the parameters), before the sender reuses the buffer."""
        import torch

        w = self.weights
        device = w.engine.runner.device
        with w.lock:
            specs, ends = _bucket_layout(w, names, dtypes, shapes, offsets)
            try:
                buf = cuda_ipc.open_handle(handle, device)
            except WeightUpdateError as exc:
                raise w.fail(str(exc)) from None
            if buf.numel() < max(ends):
                raise w.fail(f"ipc_handle: the bucket needs {max(ends)} bytes but the buffer holds {buf.numel()}")
            received = {}
            for (name, dtype, shape), off, end in zip(specs, offsets, ends):
                chunk = w.buffer(end - off, device).copy_(buf[off:end])
                received[name] = chunk.view(dtype).reshape(shape)
            torch.cuda.synchronize(device)  # copied out before the answer lets the sender reuse its buffer
            del buf
            err = w.validate(received, None)
            if err is not None:
                raise w.fail(err)
            w.stage(received, owned=True)


def _bucket_layout(w, names, dtypes, shapes, offsets) -> tuple[list, list[int]]:
    """Each tensor's (name, dtype, shape) and the end of its bytes in the bucket buffer, checked; the
    receiver's failure (which discards staging) for a malformed layout. Caller holds w.lock."""
    import torch

    if not len(names) == len(dtypes) == len(shapes) == len(offsets):
        raise w.fail(f"names, dtypes, shapes and offsets must have equal lengths, got {len(names)}, "
                     f"{len(dtypes)}, {len(shapes)}, {len(offsets)}")
    specs = w.specs(names, dtypes, shapes)
    if any(type(o) is not int or o < 0 for o in offsets):
        raise w.fail("offsets: expected non-negative integers")
    ends = [off + math.prod(s) * torch.empty((), dtype=dt).element_size() for off, (_, dt, s) in zip(offsets, specs)]
    return specs, ends


ColocatedTransport.Receiver = ColocatedReceiver  # the engine's end, defined after the sender it answers
