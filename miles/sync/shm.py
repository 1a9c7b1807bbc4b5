"""Named shared-memory buffers: files under /dev/shm mapped as uint8 tensors.

Two processes on one host that map the same path see the same pages, so a writer's copy into the
buffer IS the delivery; nothing is serialised or sent through a socket. Paths are confined to one
directory and one prefix so that an engine never maps an arbitrary file it was pointed at.
Non-goals: cross-host memory (p2p.py sends over the network there), GPU IPC handles.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "miles-w-"


def create(nbytes: int, tag: str = "buf", touch: bool = False) -> tuple[str, "torch.Tensor"]:
    """A new zero-filled buffer of `nbytes`; returns (path, (nbytes,) uint8 tensor). The caller unlinks it.
    touch=True allocates every page now, so the first transfer into it does not pay for that."""
    import torch

    path = os.path.join(SHM_DIR, f"{PREFIX}{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    with open(path, "wb") as f:
        f.truncate(max(1, nbytes))  # sparse: pages are allocated when written
    buf = torch.from_file(path, shared=True, size=max(1, nbytes), dtype=torch.uint8)[:nbytes]
    if touch:
        buf.zero_()
    return path, buf


def attach(path: str, nbytes: int) -> "torch.Tensor":
    """Map an existing buffer; raises ValueError naming the problem (wrong place, missing, too small)."""
    import torch

    check_path(path)
    try:
        size = os.path.getsize(path)
    except OSError:
        raise ValueError(f"shared-memory buffer {path} does not exist (was it unlinked by its owner?)") from None
    if size < nbytes:
        raise ValueError(f"shared-memory buffer {path} holds {size} bytes but {nbytes} were announced")
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def check_path(path: str) -> None:
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(SHM_DIR) or not os.path.basename(real).startswith(PREFIX):
        raise ValueError(f"shared-memory path {path!r} must be a file named {PREFIX}* directly in {SHM_DIR}")


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def layout(bucket) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a bucket buffer (each aligned to 64 bytes), and the total size."""
    offsets, off = [], 0
    for _, t in bucket:
        off = (off + 63) // 64 * 64
        offsets.append(off)
        off += t.numel() * t.element_size()
    return offsets, off


def write_bucket(buf: "torch.Tensor", bucket, offsets: list[int]) -> None:
    """Copy every tensor's bytes straight into `buf` at its offset (one copy, no staging buffer)."""
    for (_, t), off in zip(bucket, offsets):
        n = t.numel() * t.element_size()
        if n:
            buf[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(_uint8()))


def bucket_meta(bucket, offsets: list[int]) -> dict:
    return {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "offsets": offsets}


def _uint8():
    import torch

    return torch.uint8
