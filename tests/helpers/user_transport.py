"""A weight transport as a user would write one outside miles, named in a run config as
`sync.transport = "tests.helpers.user_transport:ShmFileTransport"`.

It writes each bucket into a fresh shared-memory file of its own and has the engine stage it through
the built-in `/update_weights_from_tensor` route (so it needs no engine-side Receiver), then commits.
Non-goals: speed (a new file per bucket), failure handling beyond refusing the commit.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.sync import shm
from miles.sync.engine_client import EngineClient
from miles.sync.prepare import SyncConfig
from miles.sync.transports import TransportError


@dataclass
class ShmFileConfig(SyncConfig):
    """The `sync` table when this transport is chosen: one setting of its own."""

    file_tag: str = "user"
    """Tag in the name of every shared-memory file this transport writes."""


class ShmFileTransport:
    Config = ShmFileConfig
    Receiver = None  # rides on the built-in engine's shared-memory route
    supports_colocation = supports_lora = supports_pd_disaggregation = True

    def __init__(self, admin_token: str | None, timeout_s: float, file_tag: str):
        self.admin_token, self.timeout_s, self.file_tag = admin_token, timeout_s, file_tag
        self.engine_urls: list[str] = []
        self.written: list[str] = []  # every file it wrote (the test checks the tag reached here)
        self._client: EngineClient | None = None
        self._fresh = True

    @classmethod
    def from_config(cls, cfg: ShmFileConfig, admin_token: str | None, base_path: str = "") -> ShmFileTransport:
        return cls(admin_token, cfg.timeout_s, cfg.file_tag)

    def connect(self, engine_urls: list[str]) -> None:
        self.engine_urls = list(engine_urls)
        self._client = EngineClient(self.admin_token, self.timeout_s)

    def send_bucket(self, bucket) -> None:
        offsets, nbytes = shm.layout(bucket)
        path, buf = shm.create(nbytes, tag=self.file_tag)
        try:
            shm.write_bucket(buf, bucket, offsets)
            self._client.post_all(self.engine_urls, "/update_weights_from_tensor", {
                **shm.bucket_meta(bucket, offsets), "load_format": "shm", "shm_path": path, "commit": False,
                "reset_staging": self._fresh})
        finally:
            shm.unlink(path)  # the engine copied the bytes out before it replied
        self.written.append(path)
        self._fresh = False

    def commit(self, weight_version: int) -> None:
        if self._client is None:
            raise TransportError("not connected")
        self._fresh = True
        self._client.post_all(self.engine_urls, "/update_weights_from_tensor", {
            "names": [], "load_format": "shm", "commit": True, "weight_version": int(weight_version)})

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None
