"""Files a client names in a weight update: read only regular files, and only where they belong.

An admin request can name a checkpoint directory, a delta version directory and the shard files an
index lists. Opened as given, a path could be absolute or climb out with `../`, follow a symlink to
another user's file, or be a FIFO or a device that blocks the reading thread forever. Everything a
weight update reads goes through here: a shard is a plain name inside its version directory, opened
without following links and without blocking, and read only if it is a regular file.
Non-goals: access control beyond the engine's own user (the OS decides what it may read).
"""

from __future__ import annotations

import os
import stat


class UnsafePath(ValueError):
    """A path a weight update may not read; the message names the path and why."""


def check_regular(path: str) -> None:
    """Refuse anything but a regular file at `path` (links to one are fine: checkpoints in the Hugging
    Face cache are symlinks into its blob store)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UnsafePath(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path}: not a regular file")


def read_inside(directory: str, name: str) -> bytes:
    """The bytes of the file `name` directly inside `directory`: a plain file name (no separator, no
    `..`), not a symlink, a regular file. Raises UnsafePath naming the file, FileNotFoundError if absent."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name \
            or (os.sep != "/" and os.sep in name):
        raise UnsafePath(f"{name!r}: expected a file name inside {directory}, not a path")
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        # ELOOP: the name is a symlink (O_NOFOLLOW); others: unreadable.
        raise UnsafePath(f"{path}: {'a symlink' if os.path.islink(path) else exc.strerror}; expected a "
                         "regular file") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePath(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)
