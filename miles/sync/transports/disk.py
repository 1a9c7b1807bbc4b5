"""Disk transport: every version as a full safetensors checkpoint, loaded by SGLang's own route.

Per version the trainer writes each bucket as one safetensors shard into a fresh directory under
`sync.disk_dir` (a directory every engine host reads), copies the base checkpoint's config files
next to them, and only then POSTs SGLang's /update_weights_from_disk {model_path, weight_version,
flush_cache} to every engine. The directory is renamed into place complete, so an engine never reads
a half-written version; the previous version's directory is removed once every engine loaded the new
one. No miles extension is involved: this is the transport for plain SGLang servers far away (no
shared collective), and it works the same on built-in engines.

Atomicity: a built-in engine stages the whole checkpoint and switches at once. SGLang loads in place,
so the updater pauses SGLang engines around the load (updater.py). A failed write is never loaded.
Rollback: the previous version's directory stays until every engine loaded the next one, so a version
that failed on some engines is undone by loading it again on all (`restore`), at no cost to a push
that succeeds.
Non-goals: deltas (disk_delta.py sends only the changed bytes, as a miles extension).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.config.loader import ConfigError
from miles.sync.prepare import SyncConfig
from miles.sync.transports.base import TransportError, reconnect
from miles.versions import to_wire

if TYPE_CHECKING:
    import torch

# What an engine needs next to the weights to load a checkpoint directory.
_CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass
class DiskConfig(SyncConfig):
    """The `sync` table when sync.transport = 'disk'."""

    transport: str = "disk"
    """How buckets reach the engines (see SyncConfig)."""
    disk_dir: str = ""
    """Directory every engine host can read, where each version's checkpoint is written."""

    def validate(self) -> None:
        super().validate()
        if not self.disk_dir:
            raise ConfigError("sync.transport = 'disk' needs sync.disk_dir: a directory every engine host can read "
                              "(e.g. --sync.disk_dir /shared/run/weights)")


class DiskTransport:
    """The sender: writes the version's shards, then has every engine load the directory."""

    Config = DiskConfig
    Receiver = None  # SGLang's /update_weights_from_disk, served by every engine
    supports_colocation = supports_lora = supports_pd_disaggregation = True

    def __init__(self, disk_dir: str = "", base_path: str = "", admin_token: str | None = None,
                 timeout_s: float = 300.0):
        if not disk_dir:
            raise ValueError("disk needs disk_dir (where versions are written): set sync.disk_dir")
        self.disk_dir, self.base_path = disk_dir, base_path
        self.admin_token, self.timeout_s = admin_token, timeout_s
        self.engine_urls: list[str] = []
        self._client = None
        self._shards = 0
        self._failed: str | None = None
        self._served: str | None = None  # the directory every engine loaded last
        self._served_version: int | None = None  # its weight version

    @classmethod
    def from_config(cls, cfg: DiskConfig, admin_token: str | None, base_path: str = "") -> DiskTransport:
        return cls(disk_dir=cfg.disk_dir, base_path=base_path, admin_token=admin_token, timeout_s=cfg.timeout_s)

    def connect(self, engine_urls: list[str]) -> None:
        self._client = reconnect(self, engine_urls, self.timeout_s)
        os.makedirs(self.disk_dir, exist_ok=True)
        self._begin()

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        if self._client is None:
            raise TransportError("disk transport is not connected: call connect(engine_urls) first")
        if not bucket:
            return
        shard = os.path.join(self._pending, f"model-{self._shards:05d}.safetensors")
        self._shards += 1
        try:
            os.makedirs(self._pending, exist_ok=True)
            save_file({n: t.detach().to("cpu").contiguous() for n, t in bucket}, shard)
        except OSError as exc:
            self._failed = f"writing {shard} failed: {exc}"
            raise TransportError(f"disk: {self._failed}") from None

    def commit(self, weight_version: int) -> None:
        if self._client is None:
            raise TransportError("disk transport is not connected: call connect(engine_urls) first")
        if self._failed is not None:
            why = self._failed
            self._begin()
            raise TransportError(f"not committing weight version {weight_version}: {why}; no engine reloaded")
        final = os.path.join(self.disk_dir, f"v{weight_version:08d}")
        try:
            for name in _CONFIG_FILES:
                src = os.path.join(self.base_path, name)
                if os.path.exists(src):
                    shutil.copy(src, self._pending)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(self._pending, final)  # complete, or not there at all
        except OSError as exc:
            self._begin()
            raise TransportError(f"disk: finishing version {weight_version} in {final} failed: {exc}") from None
        try:
            self._client.post_all(self.engine_urls, "/update_weights_from_disk", {
                "model_path": final, "weight_version": to_wire(weight_version), "flush_cache": True,
                "abort_all_requests": False})
        finally:
            self._begin()
        if self._served is not None and self._served != final:
            shutil.rmtree(self._served, ignore_errors=True)
        self._served, self._served_version = final, weight_version

    def restore(self, engine_urls: list[str]) -> tuple[int, str] | None:
        """Load the version every engine loaded last again, on each of `engine_urls` (relabelled first:
        an engine's version never moves backwards on a load). Returns (version, directory), or None when
        this sender has no such version (nothing loaded yet). Raises TransportError naming the engines
        that did not take it."""
        if self._served is None or self._client is None:
            return None
        label = to_wire(self._served_version)
        failed = []
        for url in engine_urls:  # one by one, so that the error names exactly the engines left behind
            try:
                self._client.post(url, "/update_weight_version", {"new_version": label})
                self._client.post(url, "/update_weights_from_disk", {
                    "model_path": self._served, "weight_version": label, "flush_cache": True,
                    "abort_all_requests": False})
            except TransportError as exc:
                failed.append(f"{url} ({exc})")
        if failed:
            raise TransportError(f"reloading version {self._served_version} from {self._served} failed on "
                                 + ", ".join(failed))
        return self._served_version, self._served

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None

    def _begin(self) -> None:
        """Start a new version: a fresh pending directory, nothing failed yet."""
        self._pending = os.path.join(self.disk_dir, f".pending-{os.getpid()}")
        shutil.rmtree(self._pending, ignore_errors=True)
        self._shards, self._failed = 0, None
