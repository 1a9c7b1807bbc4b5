"""Disk-delta transport: ship only the bytes that changed, through a directory every host can read.

Layout of one version (written by the trainer, read by every engine host):

    <delta_dir>/v00000007/shard-00000.zst ...   one file per bucket; each tensor is its own zstd frame
    <delta_dir>/v00000007/index.json            written last; a version without it does not exist
    index = {format, version, base_version, encoding: "xor-zstd",
             tensors: {name: {shard, offset, length, nbytes, dtype, shape, xxh3_128}}}

Encoding: per tensor, XOR of its bytes (in the engine's wire dtype) against the previous version's
bytes, zstd-compressed. Bytes that did not change XOR to zero and compress to almost nothing, so the
wire size follows the fraction of changed bytes. A weight sent quantized (precision/wire.py) is
diffed as its format's bytes; its first base is the checkpoint's weight quantized the same way on
both ends. `xxh3_128` is the checksum of the RESULTING tensor,
bound to its name, dtype and shape (verify.bound_checksum), so a host proves it rebuilt exactly the
trainer's tensor under that name, whatever went wrong on the way (entries swapped between two tensors
of one shape included). Shards are plain file names inside the version directory, read only as
regular files (sync/files.py); a malformed index is refused field by field.
Every file is written atomically (temp file, fsync, rename; then the directory is fsynced). The
format itself (encoding, index, the local copy and its patching) is delta_format.py.

The base (version `base_version`, default 0) is the run's starting checkpoint: each engine copies it
once into its host's local dir and keeps a local copy that every delta patches in turn. Applying is
two-phase across the fleet: every engine first patches and verifies into staging; only when every
engine has succeeded does any engine commit (reload). A missing or truncated shard, a corrupt frame,
a checksum mismatch or a delta built on another base version refuses the update on that engine, the
transport then discards staging everywhere, and every engine keeps serving the previous version.
The trainer's reference copy (and each engine's local copy) advance only after a successful commit.

Engines joining mid-run (a replaced engine, a grown fleet) have no local copy at the fleet's version:
connect() gives each newcomer a copy of the base, and the next version reaches it as a catch-up delta,
written alongside the regular one, from the base straight to that version
(`<delta_dir>/join/v00000008/`, the same layout and checksums). Every engine stages its own delta in
the same two-phase apply, so the newcomer commits the version with the rest of the fleet, verified
tensor by tensor, or nobody does; the catch-up is deleted once committed. Until then the newcomer
serves what bring-up pushed it (fleet.py; a fresh transport writing under `<delta_dir>/bring-up`).

The engine's end (Receiver): /init_delta_base makes the local copy; /update_weights_from_disk with
load_format "miles_delta" patches it with one version's delta, verifies and stages the result.

Memory: the trainer keeps one copy of the engine weights (the previous version) plus the pending
version until commit. Refused with colocation, LoRA and prefill/decode disaggregation (config).
Non-goals: replaying the chain of deltas since the base (pruned after `keep_versions`; one catch-up
delta replaces it); cross-host shard transfer (the delta dir is a shared or replicated filesystem).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from miles.config.loader import ConfigError
from miles.engine_api.client import EngineClient
from miles.sync.prepare import SyncConfig
from miles.sync.transports.base import TransportError, TransportReceiver, WeightUpdateError, reconnect
from miles.sync.transports.delta_format import (ENCODING, FORMAT, INDEX, DeltaCopy, DeltaError, encode, join_dir,
                                                load_base, version_dir, write_atomic)
from miles.trainer.checkpoint import fsync_dir
from miles.versions import to_wire

if TYPE_CHECKING:
    import torch

# ---- trainer side: the transport --------------------------------------------------------------


@dataclass
class DiskDeltaConfig(SyncConfig):
    """The `sync` table when sync.transport = 'disk_delta'."""

    transport: str = "disk_delta"
    """How buckets reach the engines (see SyncConfig)."""
    delta_dir: str = ""
    """Directory every engine host can read, where each version's delta is written."""
    delta_local_dir: str = ""
    """Each host's local dir for its copy of the base checkpoint (default: delta_dir/local)."""

    def for_new_engines(self) -> DiskDeltaConfig:
        """Bring-up writes through a transport of its own: its versions go to a directory apart from
        the run's, so they never replace a version the serving engines applied; the host's base copy
        is shared."""
        cfg = super().for_new_engines()
        return dataclasses.replace(cfg, delta_dir=os.path.join(self.delta_dir, "bring-up"),
                                   delta_local_dir=self.delta_local_dir or os.path.join(self.delta_dir, "local"))

    def validate(self) -> None:
        super().validate()
        if not self.delta_dir:
            raise ConfigError("sync.transport = 'disk_delta' needs sync.delta_dir: a directory every engine host "
                              "can read (e.g. --sync.delta_dir /shared/run/deltas)")


class DiskDeltaTransport:
    """The sender: writes each version's delta against the previous one, then applies it in two phases."""

    Config = DiskDeltaConfig
    after_write: Callable[[list[str]], None] | None = None  # see __init__
    # Colocated engines share the trainer's machine (nothing to save on the wire); a LoRA run and
    # prefill/decode-disaggregated engines do not hold the full base weights the delta patches.
    supports_colocation = supports_lora = supports_pd_disaggregation = False

    def __init__(self, delta_dir: str = "", base_path: str = "", local_dir: str = "", base_version: int = 0,
                 admin_token: str | None = None, timeout_s: float = 300.0, zstd_level: int = 3,
                 keep_versions: int = 2):
        if not delta_dir or not base_path:
            raise ValueError("disk_delta needs delta_dir (where versions are written) and base_path (the run's "
                             "starting checkpoint): set sync.delta_dir and model.path")
        self.delta_dir, self.base_path = delta_dir, base_path
        self.local_dir = local_dir or os.path.join(delta_dir, "local")
        self.base_version = base_version
        self.admin_token, self.timeout_s = admin_token, timeout_s
        self.zstd_level, self.keep_versions = zstd_level, keep_versions
        self.engine_urls: list[str] = []
        self._client: EngineClient | None = None
        self._prev: dict | None = None  # name -> tensor at self._version (what every engine holds)
        self._version = base_version
        self._pending: dict = {}  # this version's tensors, and their index entries
        self._entries: dict = {}
        self._shards = 0
        self._failed: str | None = None
        self._joining: set[str] = set()  # engines whose local copy is the base: sent a catch-up delta
        self.last_stats: dict[str, float] = {}
        # Called once with the version's directories between writing and applying them, then cleared:
        # fault injection damages them here (WeightUpdater.tamper_next_version).
        self.after_write = None

    @classmethod
    def from_config(cls, cfg: DiskDeltaConfig, admin_token: str | None, base_path: str = "") -> DiskDeltaTransport:
        return cls(delta_dir=cfg.delta_dir, base_path=base_path, local_dir=cfg.delta_local_dir,
                   admin_token=admin_token, timeout_s=cfg.timeout_s)

    def connect(self, engine_urls: list[str]) -> None:
        """Connect to `engine_urls`; engines not connected before get a local copy of the base, and,
        once this transport is past the base version, the next version as a catch-up delta."""
        known = set(self.engine_urls)
        self._client = reconnect(self, engine_urls, self.timeout_s)
        if self._prev is None:
            self._prev = load_base(self.base_path)
        os.makedirs(self.delta_dir, exist_ok=True)
        new = [u for u in self.engine_urls if u not in known]
        if new:
            self._client.post_all(new, "/init_delta_base", {
                "base_path": self.base_path, "local_dir": self.local_dir, "base_version": self.base_version})
        self._joining = {u for u in self._joining if u in self.engine_urls}
        if self._version != self.base_version:
            self._joining.update(new)
        self._begin()

    def send_bucket(self, bucket: list[tuple[str, "torch.Tensor"]]) -> None:
        import zstandard

        from miles.precision import wire

        self._check()
        if not bucket:
            return
        os.makedirs(self._vdir_tmp(), exist_ok=True)
        shard = f"shard-{self._shards:05d}.zst"
        self._shards += 1
        cctx = zstandard.ZstdCompressor(level=self.zstd_level, write_checksum=True)
        frames, offset = [], 0
        try:
            for name, t in bucket:
                prev = wire.from_base(self._prev, name)  # quantized bytes: XORed with the previous bytes
                if prev is None:
                    raise TransportError(f"disk_delta: tensor {name!r} is not in the base checkpoint {self.base_path}")
                t = t.detach().to("cpu").contiguous()
                prev = prev.to(t.dtype)
                if prev.shape != t.shape:
                    raise TransportError(f"disk_delta: tensor {name!r} has shape {list(t.shape)} but the base "
                                         f"checkpoint has {list(prev.shape)}")
                frame, x, entry = encode(cctx, name, t, prev, shard, offset)
                frames.append(frame)
                self._stats["delta/changed_bytes"] += int(x.size - (x == 0).sum())
                self._stats["delta/full_bytes"] += x.size
                self._entries[name] = entry
                self._pending[name] = t.clone()
                offset += len(frame)
            write_atomic(os.path.join(self._vdir_tmp(), shard), frames)
            self._stats["delta/wire_bytes"] += offset
        except OSError as exc:
            self._failed = f"writing {shard} (tensors {bucket[0][0]!r}...) failed: {exc}"
            raise TransportError(f"disk_delta: {self._failed}") from None
        except TransportError as exc:
            self._failed = str(exc)
            raise

    def commit(self, weight_version: int) -> None:
        vdir = self.write(weight_version)
        if self.after_write is not None:
            hook, self.after_write = self.after_write, None
            jdir = join_dir(self.delta_dir, int(weight_version))
            hook([vdir] + ([jdir] if os.path.isdir(jdir) else []))
        self.apply(weight_version)

    def write(self, weight_version: int) -> str:
        """Finish writing this version (its index, atomically); returns the version's directory."""
        self._check()
        if self._failed is not None:
            why = self._failed
            self._begin()
            raise TransportError(f"not committing weight version {weight_version}: {why}; no engine reloaded")
        version = int(weight_version)
        if version == self._version:
            raise TransportError(f"disk_delta: version {version} is the version engines already hold; "
                                 "each update needs a new version number")
        index = {"format": FORMAT, "version": version, "base_version": self._version, "encoding": ENCODING,
                 "tensors": self._entries}
        vdir = version_dir(self.delta_dir, version)
        try:
            tmp = self._vdir_tmp()
            os.makedirs(tmp, exist_ok=True)
            write_atomic(os.path.join(tmp, INDEX), json.dumps(index).encode())
            fsync_dir(tmp)
            if os.path.exists(vdir):
                shutil.rmtree(vdir)
            os.replace(tmp, vdir)
            fsync_dir(self.delta_dir)
        except OSError as exc:
            self._begin()
            raise TransportError(f"not committing weight version {version}: writing its index failed ({exc}); "
                                 "no engine reloaded") from None
        if self._joining:
            self._write_catch_up(version)
        self.last_stats = dict(self._stats)
        return vdir

    def _write_catch_up(self, version: int) -> str:
        """This version's tensors as one delta from the base, for the engines that joined since the last
        commit (their local copy is the base). Read from the base checkpoint again: the trainer keeps
        the base only for as long as it writes this."""
        import zstandard

        base = load_base(self.base_path)
        jdir = join_dir(self.delta_dir, version)
        tmp = jdir + ".incoming"
        cctx = zstandard.ZstdCompressor(level=self.zstd_level, write_checksum=True)
        entries, by_shard = {}, {}
        for name, e in self._entries.items():
            by_shard.setdefault(e["shard"], []).append(name)
        try:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
            for shard, names in by_shard.items():
                frames, offset = [], 0
                for name in names:
                    t = self._pending[name]
                    frame, _, entries[name] = encode(cctx, name, t, base[name].to(t.dtype), shard, offset)
                    frames.append(frame)
                    offset += len(frame)
                write_atomic(os.path.join(tmp, shard), frames)
                self._stats["delta/catch_up_bytes"] = self._stats.get("delta/catch_up_bytes", 0) + offset
            index = {"format": FORMAT, "version": version, "base_version": self.base_version, "encoding": ENCODING,
                     "tensors": entries}
            write_atomic(os.path.join(tmp, INDEX), json.dumps(index).encode())
            fsync_dir(tmp)
            if os.path.exists(jdir):
                shutil.rmtree(jdir)
            os.replace(tmp, jdir)
            fsync_dir(os.path.dirname(jdir))
        except OSError as exc:
            self._begin()
            raise TransportError(f"not committing weight version {version}: writing the catch-up delta for "
                                 f"{sorted(self._joining)} failed ({exc}); no engine reloaded") from None
        return jdir

    def apply(self, version: int) -> None:
        """Two-phase apply of an already-written version: every engine stages and verifies, then all commit."""
        vdir, jdir = version_dir(self.delta_dir, version), join_dir(self.delta_dir, version)
        joining = [u for u in self.engine_urls if u in self._joining]
        steady = [u for u in self.engine_urls if u not in self._joining]
        try:
            for urls, path in ((steady, vdir), (joining, jdir)):
                if urls:
                    self._client.post_all(urls, "/update_weights_from_disk",
                                          {"load_format": "miles_delta", "model_path": path, "commit": False})
        except TransportError as exc:
            self._client.post_all(self.engine_urls, "/update_weights_from_disk", {"reset_staging": True})
            self._begin()
            raise TransportError(f"weight version {version} refused, no engine reloaded, every engine keeps "
                                 f"version {self._version}: {exc}") from None
        self._client.post_all(self.engine_urls, "/update_weights_from_disk",
                              {"load_format": "miles_delta", "commit": True, "weight_version": to_wire(version)})
        self._prev.update(self._pending)
        self._version = version
        self._joining.clear()
        shutil.rmtree(os.path.dirname(jdir), ignore_errors=True)
        self._begin()
        self._prune()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None

    # ---- internals ----------------------------------------------------------------------------

    def _begin(self) -> None:
        tmp = self._vdir_tmp()
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        self._pending, self._entries, self._shards, self._failed = {}, {}, 0, None
        self._stats = {"delta/changed_bytes": 0, "delta/full_bytes": 0, "delta/wire_bytes": 0}

    def _vdir_tmp(self) -> str:
        return os.path.join(self.delta_dir, ".incoming")

    def _prune(self) -> None:
        versions = sorted(d for d in os.listdir(self.delta_dir) if d.startswith("v") and d[1:].isdigit())
        for d in versions[:-self.keep_versions] if self.keep_versions > 0 else []:
            shutil.rmtree(os.path.join(self.delta_dir, d), ignore_errors=True)

    def _check(self) -> None:
        if self._client is None:
            raise TransportError("disk_delta transport is not connected: call connect(engine_urls) first")


# ---- engine side ----------------------------------------------------------------------------------


class DiskDeltaReceiver(TransportReceiver):
    """The engine's end: the host's local copy, patched by each delta into staging."""

    extension = "disk_delta"

    def __init__(self, weights):
        super().__init__(weights)
        self._copy: DeltaCopy | None = None  # the local copy of the base checkpoint, at its current version
        self._pending: tuple[int, dict] | None = None  # (version, tensors) staged; the local copy at commit

    def mount(self, api) -> None:
        api.post("/init_delta_base", self._init_route, fields={"base_path", "local_dir", "base_version"})
        api.disk_formats["miles_delta"] = self.stage_delta

    def _init_route(self, body: dict) -> dict:
        base, local = body.get("base_path"), body.get("local_dir")
        if not isinstance(base, str) or not isinstance(local, str):
            raise WeightUpdateError("base_path and local_dir: send the run's starting checkpoint and this host's dir")
        base_version = body.get("base_version", 0)
        if type(base_version) is not int or base_version < 0:
            raise WeightUpdateError("base_version: expected a non-negative integer")
        try:
            return {"success": True, "message": self.init_base(base, local, base_version)}
        except (DeltaError, OSError) as exc:
            raise WeightUpdateError(f"base_path: {exc}") from None

    def init_base(self, base_path: str, local_dir: str, base_version: int = 0) -> str:
        """Copy the run's base checkpoint into this host's local dir (once) and load it as the local copy."""
        copy = DeltaCopy.from_base(base_path, local_dir, base_version, check=self.weights.validate)
        with self.weights.lock:
            self._copy, self._pending = copy, None
        return f"local copy of {base_path} at version {base_version} in {local_dir}"

    def stage_delta(self, version_dir: str) -> str:
        """Patch the local copy with one delta, verify every tensor, stage it; returns what was staged."""
        w = self.weights
        with w.lock:
            if self._copy is None:
                raise w.fail("no local base copy: call /init_delta_base before sending disk deltas")
            try:
                version, tensors = self._copy.patch(version_dir)
            except DeltaError as exc:
                raise w.fail(str(exc)) from None
            err = w.validate(tensors)
            if err is not None:
                raise w.fail(err)
            w.stage(tensors, owned=False)  # the local copy keeps these: copied at commit
            self._pending = (version, tensors)
            return f"delta to version {version} verified and staged"

    def committed(self, adopted: str | None) -> None:
        if self._pending is not None:
            self._copy.advance(*self._pending)
            self._pending = None

    def discarded(self) -> None:
        self._pending = None


DiskDeltaTransport.Receiver = DiskDeltaReceiver  # the engine's end, defined after the sender it answers
