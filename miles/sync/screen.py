"""The NaN/Inf screen a sender runs on the weights it sends, so that engines need not read them again.

Every weight update is screened before an engine applies it: a NaN or Inf from a diverged trainer
must never be served. A sender of miles' own screens the bytes as it copies them (into a flat
message or into an engine's shared memory), where the screen reads cache-hot data, and tells the
engines so (`screened`); an engine then stages the bytes unread. Anything not vouched for this way
(SGLang's own formats, a sender's shared-memory buffer, a disk load) is screened by the engine.
Non-goals: catching bytes damaged in transit (the per-bucket checksums verify.py compares do that).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from miles.sync import verify

if TYPE_CHECKING:
    import torch

# Bytes copied per step of copy_screened: small enough that the chunk read for the first destination
# is still in cache (L2 or L3) for the next ones and for the NaN/Inf screen, large enough that the
# Python around each step (three torch calls) stays a small part of it.
CHUNK_BYTES = 4 << 20


def copy_screened(bufs: list["torch.Tensor"], bucket, offsets: list[int], threads: int = 1) -> list[str]:
    """Copy every tensor's bytes into each buffer of `bufs` at its offset, and screen floating-point
    tensors for NaN/Inf on the way; returns the names of those holding any.

    Each chunk of the source is read from memory once: the copies after the first and the screen find
    it in cache, so N destinations plus the screen cost about N copies, where separate copies and a
    separate screen pass would read the source N + 1 times. `threads` share the chunks (copies and
    sums release the GIL)."""
    import torch

    chunks = []  # (tensor index, first byte, end byte) within the tensor
    for i, (_, t) in enumerate(bucket):
        n = t.numel() * t.element_size()
        chunks += [(i, lo, min(n, lo + CHUNK_BYTES)) for lo in range(0, n, CHUNK_BYTES)]
    srcs = [t.detach().contiguous().reshape(-1) for _, t in bucket]
    raw = [s.view(torch.uint8) for s in srcs]
    sums: list[list] = [[] for _ in bucket]  # per tensor, its chunks' sums (lists append atomically)
    errors: list[BaseException] = []

    def run(part) -> None:
        try:
            copy(part)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            errors.append(exc)

    def copy(part) -> None:
        for i, lo, hi in part:
            src, off = raw[i][lo:hi], offsets[i]
            for buf in bufs:
                buf[off + lo:off + hi].copy_(src)
            if srcs[i].is_floating_point():
                # A sum is a fast screen (NaN/Inf make it non-finite); the exact check runs only on a hit.
                sums[i].append(src.view(srcs[i].dtype).sum())

    threads = max(1, min(threads, len(chunks)))
    per = -(-len(chunks) // threads)
    workers = [threading.Thread(target=run, args=(chunks[k * per:(k + 1) * per],), daemon=True)
               for k in range(1, threads)]
    for w in workers:
        w.start()
    run(chunks[:per])
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return [bucket[i][0] for i, parts in enumerate(sums)
            if parts and not bool(torch.isfinite(torch.stack(parts)).all()) and not verify.finite(srcs[i])]


def nonfinite(bucket) -> list[str]:
    """Names of the (name, tensor) pairs holding NaN/Inf: the screen of tensors sent from their own memory."""
    return [name for name, t in bucket if not verify.finite(t)]
