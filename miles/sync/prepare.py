"""Preparation: full tensors → engine names/layouts/dtypes → fixed-size buckets → transport.

The caller's iterator yields full tensors one at a time (gathered from FSDP / tensor- / expert-
parallel shards just before), a converter (convert.py, chosen per architecture) renames or fuses
them into what the engine loads, and buckets fill up to `bucket_size_mb` (update_weight_buffer_size).
Each full bucket goes to the transport at once, so the extra memory held here peaks at about one
bucket. Tensors a converter marks as one group (e.g. the pieces of a fused projection) are never
split across buckets. The version is committed only after the last bucket, so engines switch to the
new weights all at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

MiB = 1 << 20


@dataclass
class SyncConfig:
    transport: str = "broadcast"
    """How buckets reach the engines: broadcast, p2p, disk_delta or colocated."""
    bucket_size_mb: int = 512
    """Bucket size in MiB (update_weight_buffer_size); each full bucket is one transfer."""
    dtype: str | None = None
    """Cast weights to this dtype for the engine (e.g. bfloat16). None: the built-in engines' dtype
    (rollout.engine.dtype), or the trainer's own dtype for engines given by rollout.engine_urls."""
    converter: str = "auto"
    """Name/layout converter: auto (by model_type), hf (names as they are), or a module:function path."""
    verify_first_update: bool = True
    """Noise-fill every engine before the run's first update, then compare it with the trainer tensor by tensor."""
    verify_checksums: bool = True
    """After every later update, compare one xxh3-128 checksum per bucket between trainer and engines."""
    p2p_mode: str = "auto"
    """p2p channel: auto (shared memory on this host, point-to-point sends across hosts), shm or tcp."""
    delta_dir: str = ""
    """disk_delta: directory every engine host can read, where each version's delta is written."""
    delta_local_dir: str = ""
    """disk_delta: each host's local dir for its copy of the base checkpoint (default: delta_dir/local)."""
    timeout_s: float = 120.0
    """How long one transfer or engine call may take before the update fails."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.bucket_size_mb < 1:
            raise ConfigError("sync.bucket_size_mb must be >= 1")
        from miles.sync.transports import TRANSPORTS

        if self.transport not in TRANSPORTS:
            raise ConfigError(f"sync.transport {self.transport!r} is unknown: choose one of {sorted(TRANSPORTS)}")
        if self.p2p_mode not in ("auto", "shm", "tcp"):
            raise ConfigError(f"sync.p2p_mode {self.p2p_mode!r}: choose auto, shm or tcp")
        if self.transport == "disk_delta" and not self.delta_dir:
            raise ConfigError("sync.transport = 'disk_delta' needs sync.delta_dir: a directory every engine host "
                              "can read (e.g. --sync.delta_dir /shared/run/deltas)")
        if self.timeout_s <= 0:
            raise ConfigError("sync.timeout_s must be > 0")
        if self.converter not in ("auto", "hf"):
            from miles.sync.convert import get_converter

            try:
                get_converter(self.converter)
            except ValueError as exc:
                raise ConfigError(f"sync.converter: {exc}") from None

    def transport_kwargs(self, admin_token: str | None, base_path: str = "") -> dict:
        """Keyword config for the chosen transport (see get_transport)."""
        common = {"admin_token": admin_token, "timeout_s": self.timeout_s}
        if self.transport == "p2p":
            return {**common, "mode": self.p2p_mode, "buffer_bytes": self.bucket_size_mb * MiB}
        if self.transport == "colocated":
            return {**common, "buffer_bytes": self.bucket_size_mb * MiB}
        if self.transport == "disk_delta":
            return {**common, "delta_dir": self.delta_dir, "base_path": base_path, "local_dir": self.delta_local_dir}
        return common


def check_run(run) -> None:
    """Cross-section refusals of the weight sync (called from RunConfig.validate)."""
    from miles.config import ConfigError

    if run.sync.dtype is None and not run.rollout.engine_urls and run.rollout.engine.dtype != "float32":
        # Engines hold what they were loaded as; shipping fp32 would double the bytes and make the
        # verification compare fp32 checksums with the engine's bf16 tensors.
        run.sync.dtype = run.rollout.engine.dtype

    if run.sync.transport != "disk_delta":
        return
    if getattr(run.placement, "mode", "disaggregated") == "colocated":
        raise ConfigError("sync.transport = 'disk_delta' cannot run colocated (engines and trainer share the "
                          "machine, there is nothing to save on the wire): set sync.transport = 'colocated' or "
                          "placement.mode = 'disaggregated'")
    lora = getattr(run.trainer, "lora", None)
    if getattr(lora, "rank", 0):
        raise ConfigError("sync.transport = 'disk_delta' cannot ship LoRA runs (the delta is against full base "
                          "weights): set sync.transport = 'broadcast' or 'p2p', or trainer.lora.rank = 0")
    if run.rollout.pd_disaggregation:
        raise ConfigError("sync.transport = 'disk_delta' cannot update prefill/decode-disaggregated engines: "
                          "set sync.transport = 'broadcast' or 'p2p', or turn off prefill/decode disaggregation")


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
                 record: "Record | None" = None) -> dict[str, float]:
    """Convert, cast and send every tensor in buckets, then commit `version`. Returns sync/* metrics.
    With `record`, also fills in per-tensor and per-bucket checksums (for verification)."""
    from miles.models.loading import torch_dtype

    cast = torch_dtype(dtype) if dtype else None
    t0 = time.perf_counter()
    n_buckets = n_bytes = 0
    send_s = hash_s = 0.0

    def prepared():
        items = converter(named) if converter is not None else named
        for item in items:
            group = item if isinstance(item, list) else [item]
            out = [(name, (t.to(cast) if cast is not None and t.is_floating_point() else t).contiguous())
                   for name, t in group]
            yield out if isinstance(item, list) else out[0]

    for bucket in buckets(prepared(), bucket_bytes):
        if record is not None:
            s = time.perf_counter()
            record.add(bucket)
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

    def __init__(self, per_tensor: bool):
        self.per_tensor = per_tensor
        self.tensors: dict[str, list] = {}  # name -> [dtype, xxh3_128]
        self.buckets: list[list[list[str]]] = []  # [[name, dtype], ...] per bucket
        self.digests: list[str] = []

    def add(self, bucket) -> None:
        from miles.sync import verify

        self.buckets.append([[n, verify.dtype_name(t)] for n, t in bucket])
        self.digests.append(verify.bucket_checksum(t for _, t in bucket))
        if self.per_tensor:
            for n, t in bucket:
                self.tensors[n] = [verify.dtype_name(t), verify.tensor_checksum(t)]
