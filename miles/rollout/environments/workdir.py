"""A sandbox's working directory: a size-capped tmpfs on the host, the host's file calls into it, and a
removal that cannot fail.

The directory is a tmpfs (`size=` is the disk quota, `nr_inodes=` caps the number of files) owned by
the sandbox's uid and bind-mounted into every command's namespaces: mounted on the host by the root
backend, inside a user namespace that the host reaches through /proc by the rootless one
(rootless.py). Because it is its own filesystem, removing it is one lazy unmount (or the end of that
namespace), whatever the commands built inside (a tree 1500 levels deep, millions of names); a plain
recursive delete is only the fallback. The root backend's mount source is named
`miles-sandbox-work-<owner pid>-<uid>`, so mounts a killed owner left behind are found and removed by
the next sandbox (`sweep_stale`).

The host's `read_file`/`write_file` act (often as root) on a directory the commands control, so they
walk it through directory descriptors, open only regular files, never follow a symlink anywhere on
the path, and never block on a FIFO a command planted.
Non-goals: persistence across sandboxes, quotas on the host filesystem itself.
"""

from __future__ import annotations

import contextlib
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


class SandboxUnavailable(RuntimeError):
    """This machine cannot confine a command; nothing was run."""


class WorkDirUnavailable(RuntimeError):
    """The working directory's tmpfs could not be mounted; the message says why."""


class WorkDir:
    """A sandbox's working directory as the host sees it at `path`; its entries belong to `uid`:`gid`.

    `tmpfs()` mounts a fresh one on the host (the root backend); the rootless backend mounts its tmpfs
    inside a user namespace and reaches it through /proc (rootless.py), passing `on_remove` to tear
    that down. Either way the host's file calls below walk the path one component at a time through
    directory descriptors, so no symlink a command planted is ever followed.
    """

    def __init__(self, path: Path, uid: int, gid: int, host_dir: Path, on_remove=None, act_as_owner: bool = False):
        self.path, self.uid, self.gid = path, uid, gid
        self._host_dir = host_dir  # the host directory deleted last (the mount point)
        self._on_remove = on_remove
        # A tmpfs mounted in a user namespace takes no file from a uid unmapped there (host root gets
        # EOVERFLOW): a root host then acts as the owner, with its rights only.
        self._act_as_owner = act_as_owner and os.geteuid() == 0

    @contextlib.contextmanager
    def _as_owner(self):
        if not self._act_as_owner:
            yield
            return
        # setfsuid/setfsgid are per thread: other threads of the host keep their credentials.
        _libc.setfsgid(self.gid)
        _libc.setfsuid(self.uid)
        try:
            yield
        finally:
            _libc.setfsuid(0)
            _libc.setfsgid(0)

    @classmethod
    def tmpfs(cls, uid: int, size_mb: int, parent_dir: str | None = None) -> "WorkDir":
        """A tmpfs of `size_mb` MiB mounted on the host, owned by `uid` (needs root)."""
        path = Path(tempfile.mkdtemp(prefix="miles-sandbox-", dir=parent_dir))
        source = f"{SOURCE_PREFIX}{os.getpid()}-{uid}"
        if _libc.mount(source.encode(), str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                       tmpfs_options(size_mb, uid, uid).encode()) != 0:
            err = ctypes.get_errno()
            os.rmdir(path)
            raise WorkDirUnavailable(f"mounting a {size_mb} MiB tmpfs on {path} failed ({os.strerror(err)})")
        return cls(path, uid, uid, path, on_remove=lambda: _unmount(path))

    # ---- the host's file calls -------------------------------------------------------------------

    def _parts(self, rel: str) -> tuple[str, ...]:
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise SandboxError(f"path {rel!r}: give a relative path inside the sandbox directory, without '..'")
        return p.parts

    def _open_parent(self, rel: str, create: bool) -> tuple[int, str]:
        """A descriptor of the directory that holds `rel`'s last component, and that component.

        Each step is opened with O_NOFOLLOW relative to the previous one: a command may have replaced
        any directory on the way with a symlink pointing out, and the host must never act there.
        """
        parts = self._parts(rel)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts[:-1]:
                try:
                    nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    os.chown(part, self.uid, self.gid, dir_fd=fd, follow_symlinks=False)
                    nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(fd, part):
                        raise SandboxError(f"path {rel!r} passes through a symlink, which could lead outside the "
                                           "sandbox directory; refused") from None
                    if e.errno == errno.ENOTDIR:
                        raise SandboxError(f"path {rel!r}: a parent of it is not a directory; refused") from None
                    raise SandboxError(f"path {rel!r} cannot be reached ({_why(e)}); refused") from None
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def write_file(self, rel: str, content: str | bytes, mode: int = 0o644) -> None:
        with self._as_owner():
            self._write_file(rel, content, mode)

    def _write_file(self, rel: str, content: str | bytes, mode: int) -> None:
        data = content.encode() if isinstance(content, str) else content
        parent, name = self._open_parent(rel, create=True)
        try:
            # O_NONBLOCK: opening a FIFO for writing must fail at once (ENXIO), not wait for a reader.
            # No O_TRUNC before the type is known: truncating is only meant for a regular file.
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=parent)
            except OSError as e:
                _refuse_special(parent, name, rel)
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
                    f.flush()
                except OSError as e:
                    raise SandboxError(f"path {rel!r}: {_why(e)}") from None
                os.fchown(fd, self.uid, self.gid)
        finally:
            os.close(parent)

    def read_file(self, rel: str, max_bytes: int = 1 << 20) -> str | None:
        """The file's text (None if it does not exist); a symlink or other non-regular file is refused."""
        with self._as_owner():
            return self._read_file(rel, max_bytes)

    def _read_file(self, rel: str, max_bytes: int) -> str | None:
        try:
            parent, name = self._open_parent(rel, create=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
            except FileNotFoundError:
                return None
            except OSError as e:
                _refuse_special(parent, name, rel)
                raise SandboxError(f"path {rel!r} cannot be read ({_why(e)}); refused") from None
        finally:
            os.close(parent)
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
        if self._on_remove is not None:
            try:
                self._on_remove()
            except OSError:
                pass
        try:
            remove_tree(self._host_dir)
        except OSError:
            pass


def tmpfs_options(size_mb: int, uid: int, gid: int) -> str:
    """Mount options of a working directory's tmpfs: `size_mb` MiB and about one inode per 4 KiB of it
    (enough for any honest task, and a bound on the kernel memory a command can pin with empty files)."""
    return f"size={size_mb}m,nr_inodes={max(1024, size_mb * 256)},mode=0700,uid={uid},gid={gid}"


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


def _refuse_special(parent: int, name: str, rel: str) -> None:
    """Name what is at `name` when it is not a regular file (an open of a socket fails with ENXIO)."""
    try:
        st = os.lstat(name, dir_fd=parent)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise SandboxError(f"path {rel!r} is a symlink, which could lead outside the sandbox directory; refused")
    _require_regular(st, rel)


def _is_symlink(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode)
    except OSError:
        return False


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
