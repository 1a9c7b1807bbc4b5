"""Preparation: full tensors → engine names/layouts/dtypes → fixed-size buckets → transport.

The caller's iterator yields full tensors one at a time (gathered from FSDP / tensor- / expert-
parallel shards just before), a converter (convert.py, chosen per architecture) renames or fuses
them into what the engine loads, and buckets fill up to `bucket_size_mb` (update_weight_buffer_size).
Each full bucket goes to the transport at once, so the extra memory held here peaks at about one
bucket. Tensors a converter marks as one group (e.g. the pieces of a fused projection) are never
split across buckets. The version is committed only after the last bucket, so engines switch to the
new weights all at once. Weights every engine serves in a low-precision format travel as that format's
bytes and scales (precision/wire.py), quantized here from the tensor the engine would have received.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

from miles.config.loader import ConfigError
from miles.models.loading import torch_dtype
from miles.registry import RegistryError
from miles.sync import verify
from miles.sync.convert import get_converter
from miles.sync.transports import TRANSPORTS

MiB = 1 << 20


@dataclass
class SyncConfig:
    """The `sync` table. Settings every transport shares live here; a transport's own settings live in
    its Config (a subclass, in its file), which this table becomes when `transport` names it."""

    transport: str = "broadcast"
    """How buckets reach the engines: broadcast, p2p, disk_delta, colocated, or a module:Class path."""
    bucket_size_mb: int = 512
    """Bucket size in MiB (update_weight_buffer_size); each full bucket is one transfer."""
    dtype: str | None = None
    """Cast weights to this dtype for the engine (e.g. bfloat16). None: the built-in engines' dtype
    (rollout.engine.dtype), or the trainer's own dtype for engines given by rollout.engine_urls."""
    converter: str = "auto"
    """Name/layout converter: auto (by model_type), hf (names as they are), or a module:function path."""
    quantized_wire: bool = True
    """Send the weights every engine serves in a low-precision format (rollout.engine.quantization) as
    that format's bytes and scales, not full precision; false sends full precision (the engine quantizes)."""
    verify_first_update: bool = True
    """Noise-fill every engine before the run's first update, then compare it with the trainer tensor by tensor."""
    verify_checksums: bool = True
    """After every later update, compare one xxh3-128 checksum per bucket between trainer and engines."""
    timeout_s: float = 120.0
    """Deadline of one bucket's transfer (and of any one engine call) before the update fails."""
    version_timeout_s: float = 600.0
    """Deadline of one whole version's push (every bucket, the commit, the verification); past it the
    version is rolled back on every engine (none commits it) and retried."""
    retries: int = 1
    """How many more times a failed or timed-out version is pushed over the same transport before
    moving on to the transports of `fallback`. With any retry or fallback the trainer's source rank
    keeps the version's tensors until it commits (one more copy of the model there); 0 and no
    fallback keep nothing."""
    master_address: str = ""
    """Address engines reach the trainer's source rank at to join a weight-update group (broadcast, and
    p2p across nodes); empty: the address of the Ray node that hosts trainer rank 0. Ports are picked there."""
    fallback: list[str] = dataclasses.field(default_factory=list)
    """Transports to push a version with, in order, once `transport` has failed it `retries` + 1 times
    (e.g. ["broadcast", "disk"]; "disk" then writes under the system temp directory: one host only).
    Each fallback and rollback is counted (sync/fallbacks, sync/rollbacks)."""

    @classmethod
    def variant(cls, data: dict) -> type[SyncConfig]:
        """The chosen transport's Config: its own keys (e.g. sync.delta_dir) are valid only with it."""
        name = data.get("transport", cls.transport)
        if not isinstance(name, str):
            return cls  # the loader refuses the value with the key's expected type
        return transport_config(name)

    @classmethod
    def variants(cls) -> dict[str, type[SyncConfig]]:
        """Every registered transport's Config (the configuration reference lists their own keys)."""
        return {name: transport_config(name) for name in TRANSPORTS.names()}

    def for_new_engines(self) -> SyncConfig:
        """The config of the push that brings engines joining a running fleet to its weights
        (fleet.bring_up): every tensor noise-filled and compared, whatever the run's own setting."""
        cfg = self.resolved()
        if cfg is not self:  # a plain SyncConfig naming a transport: that transport's Config decides
            return cfg.for_new_engines()
        return dataclasses.replace(self, verify_first_update=True)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one bucket: what a transport's shared-memory buffers are sized to at first."""
        return self.bucket_size_mb * MiB

    def resolved(self) -> SyncConfig:
        """This config as its transport's Config; settings only that transport has take their defaults
        (a plain SyncConfig(transport=...) built in code, not through load_config), and settings only
        another transport has are dropped (a fallback from p2p to broadcast)."""
        cls = transport_config(self.transport)
        if isinstance(self, cls):
            return self
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in known})

    def validate(self) -> None:
        if self.bucket_size_mb < 1:
            raise ConfigError("sync.bucket_size_mb must be >= 1")
        transport_config(self.transport)
        if self.timeout_s <= 0:
            raise ConfigError("sync.timeout_s must be > 0")
        if self.version_timeout_s < self.timeout_s:
            raise ConfigError(f"sync.version_timeout_s = {self.version_timeout_s} is shorter than one bucket's "
                              f"deadline sync.timeout_s = {self.timeout_s}: raise it")
        if self.retries < 0:
            raise ConfigError(f"sync.retries = {self.retries}: set it >= 0")
        for name in self.fallback:
            transport_config(name)  # a typo fails here, not at the first failed push
        if self.converter not in ("auto", "hf"):
            try:
                get_converter(self.converter)
            except ValueError as exc:
                raise ConfigError(f"sync.converter: {exc}") from None


def transport_config(name: str) -> type[SyncConfig]:
    """The Config class of the transport `name` (a registered name or module:Class); ConfigError if none."""
    if name not in TRANSPORTS and ":" not in name:
        raise ConfigError(f"sync.transport {name!r} is unknown: choose one of {TRANSPORTS.names()} or give "
                          "module:Class (see miles/sync/transports/base.py)")
    try:
        config = getattr(TRANSPORTS.get(name), "Config", None)
    except RegistryError as exc:
        raise ConfigError(f"sync.transport: {exc}") from None
    if not (isinstance(config, type) and issubclass(config, SyncConfig)):
        raise ConfigError(f"sync.transport {name!r} needs a `Config` class attribute: SyncConfig itself or "
                          "a dataclass subclassing it (miles.sync.prepare.SyncConfig)")
    return config


Group = list  # [(engine name, tensor), ...] that must land in one bucket


def buckets(named: Iterable, bucket_bytes: int) -> Iterator[list[tuple[str, "object"]]]:
    """Pack (name, tensor) pairs, or groups of them (lists), into buckets of at most `bucket_bytes`.
    A group is never split; a tensor or group larger than a bucket travels alone."""
    current: list = []
    size = 0
    for item in named:
        group = item if isinstance(item, list) else [item]
        nbytes = sum(t.numel() * t.element_size() for _, t in group)
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.extend(group)
        size += nbytes
    if current:
        yield current


def push_weights(named: Iterable[tuple[str, "object"]], transport, version: int,
                 bucket_bytes: int = 512 * MiB, dtype: str | None = None, converter=None,
                 record: "Record | None" = None, quantized: dict | None = None) -> dict[str, float]:
    """Convert, cast and send every tensor in buckets, then commit `version`. Returns sync/* metrics.
    With `record`, also fills in per-tensor and per-bucket checksums (for verification).
    `quantized`: engine name -> Format of the weights the engines serve in a format; those travel as
    the format's payload (wire.py), and the record checks the values the engines will hold."""
    from miles.precision import wire  # torch: not on the config path that loads this module

    quantized = quantized or {}
    shadow: dict[str, tuple] = {}  # wire name -> (engine name, dequantized values) for the record
    cast = torch_dtype(dtype) if dtype else None
    on_device = bool(getattr(transport, "takes_device_tensors", False))
    t0 = time.perf_counter()
    n_buckets = n_bytes = 0
    send_s = hash_s = 0.0

    def prepared():
        items = converter(named) if converter is not None else named
        for item in items:
            group = item if isinstance(item, list) else [item]
            out = [(name, (t.to(cast) if cast is not None and t.is_floating_point() else t).contiguous())
                   for name, t in group]
            if not on_device:  # a transport that reads host memory (a fallback after one that did not)
                out = [(name, t.cpu()) for name, t in out]
            out = [as_quantized(name, t) if name in quantized else (name, t) for name, t in out]
            yield out if isinstance(item, list) else out[0]

    def as_quantized(name, t):
        # Quantized from the tensor the engine would have received, so the bytes are the ones it would make.
        fmt, per_matrix = quantized[name], t.dim() == 3
        payload, matrices = wire.encode(t, fmt, per_matrix)
        if record is not None:
            shadow[wire.wire_name(name, fmt)] = (name, wire.values(matrices, t.dtype, per_matrix))
        return wire.wire_name(name, fmt), payload

    for bucket in buckets(prepared(), bucket_bytes):
        if record is not None:
            s = time.perf_counter()
            record.add([shadow.pop(n) if n in shadow else (n, t) for n, t in bucket])
            hash_s += time.perf_counter() - s
        s = time.perf_counter()
        transport.send_bucket(bucket)
        send_s += time.perf_counter() - s
        n_buckets += 1
        n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        del bucket  # the transport has it; do not hold two buckets while the next fills
    s = time.perf_counter()
    transport.commit(version)
    commit_s = time.perf_counter() - s
    return {"sync/buckets": n_buckets, "sync/bytes": n_bytes, "sync/transport_s": send_s,
            "sync/commit_s": commit_s, "sync/checksum_s": hash_s, "sync/total_s": time.perf_counter() - t0}


class Record:
    """Checksums of what the trainer sent: per tensor (noise-fill check) and per bucket (later updates)."""

    def __init__(self, per_tensor: bool, digest: str = "xxh3"):
        self.per_tensor = per_tensor
        self.digest = digest  # xxh3, or sum64 for tensors on a GPU (checked where they are)
        self.tensors: dict[str, list] = {}  # name -> [dtype, xxh3_128]
        self.buckets: list[list[list[str]]] = []  # [[name, dtype], ...] per bucket
        self.digests: list[str] = []

    def add(self, bucket) -> None:
        self.buckets.append([[n, verify.dtype_name(t)] for n, t in bucket])
        self.digests.append(verify.bucket_checksum((t for _, t in bucket), self.digest))
        if self.per_tensor:
            for n, t in bucket:
                self.tensors[n] = [verify.dtype_name(t), verify.tensor_checksum(t, self.digest)]
