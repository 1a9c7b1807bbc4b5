"""Colocated transport: trainer and engines share this machine and take turns.

Nothing is serialised: the trainer copies each bucket once into a shared-memory buffer it owns and
hands the engines a handle (the buffer's path and each tensor's offset, dtype and shape); every
engine maps the same pages and copies the bytes into its staging. Engines apply at commit, all at once.
Non-goals: zero-copy into the engine's parameters (the buffer is reused for the next bucket, so
the engine must take its copy before the trainer moves on), CUDA IPC handles (a GPU build).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.sync import shm
from miles.sync.engine_client import EngineClient
from miles.sync.transports.base import TransportError

if TYPE_CHECKING:
    import torch


class ColocatedTransport:
    name = "colocated"

    def __init__(self, admin_token: str | None = None, timeout_s: float = 120.0, buffer_bytes: int = 64 << 20):
        self.admin_token, self.timeout_s, self.buffer_bytes = admin_token, timeout_s, buffer_bytes
        self.engine_urls: list[str] = []
        self._client: EngineClient | None = None
        self._path: str | None = None
        self._buf = None
        self._fresh = True
        self._failed: str | None = None

    def connect(self, engine_urls: list[str]) -> None:
        from miles.sync.transports.p2p import is_local

        if not engine_urls:
            raise ValueError("connect: no engine URLs given")
        far = [u for u in engine_urls if not is_local(u)]
        if far:
            raise TransportError(f"colocated transport: engine(s) {far} are not on this machine; use sync.transport "
                                 "= 'p2p' or 'broadcast' for engines on other hosts")
        self.close()
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self._client = EngineClient(self.admin_token, self.timeout_s)
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
                               "weight_version": int(weight_version)})

    def close(self) -> None:
        if self._path is not None:
            shm.unlink(self._path)
        self._path = self._buf = None
        if self._client is not None:
            self._client.close()
        self._client = None
