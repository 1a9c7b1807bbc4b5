"""Preparation: gathered full tensors → engine names/dtypes → fixed-size buckets → transport.

The caller's iterator yields full tensors one at a time (gathered from shards just before), so the
extra memory held here peaks at about one bucket. Every bucket is handed to the transport as soon
as it fills; the version is committed only after the last bucket, so engines switch to the new
weights all at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

MiB = 1 << 20


@dataclass
class SyncConfig:
    transport: str = "broadcast"
    """How buckets reach the engines: broadcast."""
    bucket_size_mb: int = 512
    """Bucket size in MiB (update_weight_buffer_size); each full bucket is one transfer."""
    dtype: str | None = None
    """Cast weights to this dtype for the engine (e.g. bfloat16); None keeps the trainer's dtype."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.bucket_size_mb < 1:
            raise ConfigError("sync.bucket_size_mb must be >= 1")
        from miles.sync.transports import TRANSPORTS

        if self.transport not in TRANSPORTS:
            raise ConfigError(f"sync.transport {self.transport!r} is unknown: choose one of {sorted(TRANSPORTS)}")


def buckets(named: Iterable[tuple[str, "object"]], bucket_bytes: int) -> Iterator[list[tuple[str, "object"]]]:
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (a larger tensor goes alone)."""
    current: list = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current:
        yield current


def push_weights(named: Iterable[tuple[str, "object"]], transport, version: int,
                 bucket_bytes: int = 512 * MiB, dtype: str | None = None) -> dict[str, float]:
    """Send every tensor in buckets, then commit `version`. Returns sync/* metrics."""
    from miles.models.loading import torch_dtype

    cast = torch_dtype(dtype) if dtype else None
    t0 = time.perf_counter()
    n_buckets = n_bytes = 0
    send_s = 0.0

    def converted():
        for name, t in named:
            yield name, (t.to(cast) if cast is not None and t.is_floating_point() else t).contiguous()

    for bucket in buckets(converted(), bucket_bytes):
        s = time.perf_counter()
        transport.send_bucket(bucket)
        send_s += time.perf_counter() - s
        n_buckets += 1
        n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    s = time.perf_counter()
    transport.commit(version)
    commit_s = time.perf_counter() - s
    return {"sync/buckets": n_buckets, "sync/bytes": n_bytes, "sync/transport_s": send_s,
            "sync/commit_s": commit_s, "sync/total_s": time.perf_counter() - t0}
