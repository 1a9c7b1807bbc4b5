"""A sandbox's working directory: a size-capped tmpfs on the host, the host's file calls into it, and a
removal that cannot fail.

The directory is a tmpfs mounted on the host (`size=` is the disk quota, `nr_inodes=` caps the number
of files), owned by the sandbox's uid and bind-mounted into every command's namespaces. Because it is
its own filesystem, removing it is one lazy unmount, whatever the commands built inside (a tree 1500
levels deep, millions of names); a plain recursive delete is only the fallback. The mount's source is
named `miles-sandbox-work-<owner pid>-<uid>`, so mounts a killed owner left behind are found and
removed by the next sandbox (`sweep_stale`).

The host's `read_file`/`write_file` act as root on a directory the commands control, so they open
only regular files, never follow symlinks, and never block on a FIFO a command planted.
Non-goals: persistence across sandboxes, quotas on the host filesystem itself.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat
import tempfile
from pathlib import Path

from miles.owners import alive as owner_alive

SOURCE_PREFIX = "miles-sandbox-work-"
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(ValueError):
    """A request to the sandbox itself was refused (e.g. a path outside its directory)."""


class WorkDirUnavailable(RuntimeError):
    """The working directory's tmpfs could not be mounted; the message says why."""


class WorkDir:
    """The directory at `path`, a tmpfs of `size_mb` MiB owned by `uid`."""

    def __init__(self, uid: int, size_mb: int, parent_dir: str | None = None):
        self.uid = uid
        self.path = Path(tempfile.mkdtemp(prefix="miles-sandbox-", dir=parent_dir))
        source = f"{SOURCE_PREFIX}{os.getpid()}-{uid}"
        # About one inode per 4 KiB of quota: enough for any honest task, and a bound on the kernel
        # memory a command can pin by creating empty files.
        options = f"size={size_mb}m,nr_inodes={max(1024, size_mb * 256)},mode=0700,uid={uid},gid={uid}"
        if _libc.mount(source.encode(), str(self.path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                       options.encode()) != 0:
            err = ctypes.get_errno()
            os.rmdir(self.path)
            raise WorkDirUnavailable(f"mounting a {size_mb} MiB tmpfs on {self.path} failed "
                                     f"({os.strerror(err)})")

    # ---- the host's file calls -------------------------------------------------------------------

    def host_path(self, rel: str) -> Path:
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise SandboxError(f"path {rel!r}: give a relative path inside the sandbox directory, without '..'")
        host = self.path / p
        # A command may have planted a symlink pointing out; resolve and re-check before touching it as root.
        if not str(host.resolve()).startswith(str(self.path.resolve()) + os.sep):
            raise SandboxError(f"path {rel!r} leads outside the sandbox directory (a symlink?); refused")
        return host

    def write_file(self, rel: str, content: str | bytes, mode: int = 0o644) -> None:
        host = self.host_path(rel)
        try:
            host.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise SandboxError(f"path {rel!r}: a parent of it is not a directory; refused") from None
        data = content.encode() if isinstance(content, str) else content
        # O_NONBLOCK: opening a FIFO for writing must fail at once (ENXIO), not wait for a reader.
        # No O_TRUNC before the type is known: truncating is only meant for a regular file.
        try:
            fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
        except OSError as e:
            _refuse_special(host, rel)
            raise SandboxError(f"path {rel!r} cannot be written ({_why(e)}); refused") from None
        try:
            _require_regular(os.fstat(fd), rel)
        except SandboxError:
            os.close(fd)
            raise
        with os.fdopen(fd, "wb") as f:
            os.ftruncate(fd, 0)
            os.set_blocking(fd, True)
            try:
                f.write(data)
            except OSError as e:
                raise SandboxError(f"path {rel!r}: {_why(e)}") from None
        for d in [host, *host.relative_to(self.path).parents]:
            os.lchown(self.path / d, self.uid, self.uid)

    def read_file(self, rel: str, max_bytes: int = 1 << 20) -> str | None:
        """The file's text (None if it does not exist or is a symlink); other non-regular files are refused."""
        host = self.host_path(rel)
        try:
            fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                return None
            _refuse_special(host, rel)
            raise SandboxError(f"path {rel!r} cannot be read ({_why(e)}); refused") from None
        try:
            _require_regular(os.fstat(fd), rel)
        except SandboxError:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            return f.read(max_bytes).decode(errors="replace")

    # ---- removal ---------------------------------------------------------------------------------

    def remove(self) -> None:
        """Unmount and delete; never raises. What a failure leaves is swept by the next sandbox."""
        _unmount(self.path)
        try:
            remove_tree(self.path)
        except OSError:
            pass


def sweep_stale() -> list[str]:
    """Unmount and delete the working directories of owners that no longer run."""
    removed = []
    for mountpoint, source in _own_mounts():
        owner = source[len(SOURCE_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not owner_alive(int(owner)):
            _unmount(Path(mountpoint))
            try:
                remove_tree(Path(mountpoint))
            except OSError:
                pass
            removed.append(mountpoint)
    return removed


def remove_tree(root: Path) -> None:
    """Delete `root` and everything under it, however deep, without recursion or long paths.

    Each directory is emptied through a descriptor; its subdirectories are first renamed up to sit
    directly under `root`, so no path ever grows and no more than two directories are open at once.
    Symlinks are removed, never followed.
    """
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        os.unlink(root)
        return
    try:
        pending = [None]  # None = root itself; otherwise a name directly under root
        tag = secrets.token_hex(4)
        moved = 0
        while pending:
            name = pending[-1]
            fd = root_fd if name is None else os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                                      dir_fd=root_fd)
            try:
                subdirs = []
                with os.scandir(fd) as entries:
                    for e in entries:
                        if e.is_dir(follow_symlinks=False):
                            subdirs.append(e.name)
                        else:
                            os.unlink(e.name, dir_fd=fd)
                for sub in subdirs:
                    if name is None:
                        pending.append(sub)
                    else:
                        moved += 1
                        flat = f".miles-rm-{tag}-{moved}"
                        os.rename(sub, flat, src_dir_fd=fd, dst_dir_fd=root_fd)
                        pending.append(flat)
            finally:
                if fd != root_fd:
                    os.close(fd)
            if pending[-1] == name:  # nothing left under it
                pending.pop()
                if name is not None:
                    os.rmdir(name, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    os.rmdir(root)


def _require_regular(st: os.stat_result, rel: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = {stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket", stat.S_IFDIR: "directory", stat.S_IFCHR:
                "character device", stat.S_IFBLK: "block device"}.get(stat.S_IFMT(st.st_mode), "special file")
        raise SandboxError(f"path {rel!r} is a {kind}, not a regular file; refused")


def _refuse_special(host: Path, rel: str) -> None:
    """Name what is at `host` when it is not a regular file (an open of a socket fails with ENXIO)."""
    try:
        st = os.lstat(host)
    except OSError:
        return
    if not stat.S_ISLNK(st.st_mode):
        _require_regular(st, rel)


def _why(e: OSError) -> str:
    if e.errno == errno.ENXIO:
        return "a FIFO with no reader"
    if e.errno == errno.ELOOP:
        return "a symlink"
    if e.errno == errno.ENOSPC:
        return "the sandbox's disk quota is full"
    return e.strerror or str(e)


def _unmount(path: Path) -> None:
    # MNT_DETACH: the mount leaves the tree now, and its memory is freed once nothing uses it.
    _libc.umount2(str(path).encode(), _MNT_DETACH)


def _own_mounts() -> list[tuple[str, str]]:
    """(mount point, source) of every working-directory tmpfs in this mount namespace."""
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) >= 5 and len(tail) >= 2 and tail[0] == "tmpfs" and tail[1].startswith(SOURCE_PREFIX):
            # mountinfo escapes space, tab, newline and backslash as octal.
            out.append((fields[4].encode().decode("unicode_escape"), tail[1]))
    return out
