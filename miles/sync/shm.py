"""Named shared-memory buffers: files under /dev/shm mapped as uint8 tensors.

Two processes on one host that map the same path see the same pages, so a writer's copy into the
buffer IS the delivery; nothing is serialised or sent through a socket. Paths are confined to one
directory and one prefix so that an engine never maps an arbitrary file it was pointed at.

A buffer outlives a process killed before it could unlink it (SIGKILL, OOM). So the creating
process holds an exclusive flock on each buffer it owns for as long as it lives, and every `create`
first unlinks the buffers of dead owners (`reclaim_stale`; the fleet also calls it after killing an
engine). Dead means both: no process holds the lock (the kernel drops it exactly when the owner
dies, whatever reuses its PID later) and the PID in the name is gone (so a buffer of a writer that
takes no lock, such as an older miles, is never taken from a live owner).
Non-goals: cross-host memory (p2p.py sends over the network there), GPU IPC handles.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import uuid
from typing import TYPE_CHECKING

from miles.owners import alive as owner_alive

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "miles-w-"
_held: dict[str, int] = {}  # path -> the descriptor holding this process's lock on a buffer it owns


def create(nbytes: int, tag: str = "buf", touch: bool = False) -> tuple[str, "torch.Tensor"]:
    """A new zero-filled buffer of `nbytes`; returns (path, (nbytes,) uint8 tensor). The caller unlinks it.
    touch=True allocates every page now, so the first transfer into it does not pay for that."""
    import torch

    reclaim_stale()
    name = f"{PREFIX}{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path = os.path.join(SHM_DIR, name)
    # Locked under a name reclaim_stale skips, then renamed: it is never seen unlocked under PREFIX.
    hidden = os.path.join(SHM_DIR, "." + name)
    fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, max(1, nbytes))  # sparse: pages are allocated when written
    os.rename(hidden, path)
    _held[path] = fd
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


def free_bytes() -> int:
    """Bytes still free in SHM_DIR (a tmpfs: past this, touching a buffer's page raises SIGBUS)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def reclaim_stale() -> list[str]:
    """Unlink every buffer whose owner has died (its lock is free and its PID gone); returns their paths."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(SHM_DIR, name)
        hidden = name.startswith("." + PREFIX)  # an owner died between creating and renaming it
        if not (hidden or name.startswith(PREFIX)) or path in _held:
            continue
        parts = name.lstrip(".")[len(PREFIX):].rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit() or owner_alive(int(parts[1])):
            continue
        if hidden:
            unlink(path)
            removed.append(path)
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its owner holds it
            os.close(fd)
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed



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
