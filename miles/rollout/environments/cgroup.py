"""A cgroup per sandbox: one memory limit and one process limit for all of a sandbox's processes together.

RLIMIT_AS caps each process on its own, so a command that forks N children may use N times the
limit; a memory cgroup caps their sum (files written to a tmpfs working directory count too), and
the kernel's OOM killer acts inside the group only. A pids cgroup caps the number of processes and
threads of the group as a whole, whoever they run as.

cgroup v2 (`memory.max`, `pids.max`) is used where the memory controller is delegated to this
process's cgroup; otherwise the v1 hierarchies (`memory.limit_in_bytes`, `pids.max`) where this
process may write its groups there: as root, or as a user who was given (chown) the group it runs in.
Where neither exists, `create` raises CgroupUnavailable saying what the host needs; the sandbox then
refuses to start rather than cap memory per process only. The memory controller is required; the
pids one is used where present (both backends also count processes with RLIMIT_NPROC).
Each group is a child of the cgroup this process runs in, named `miles-sandbox-<owner pid>-<tag>`,
so groups a killed owner left behind are found and removed by the next sandbox (`sweep_stale`).

Non-goals (so far): CPU or IO controllers (the sandbox keeps RLIMIT_CPU); v2 groups below a
delegated one, which would need this process's group emptied into a leaf first (the kernel hands
controllers to children only of a group that holds no process itself, the root group aside).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from miles.owners import alive as owner_alive

ROOT = Path("/sys/fs/cgroup")
PREFIX = "miles-sandbox-"
# The backends' own wrappers (unshare and the setup shell, or bwrap and its init) live in the group
# beside the command's processes, which RLIMIT_NPROC already holds to `max_processes`.
PIDS_SLACK = 4
HOST_NEEDS = ("run as root on a host with cgroup v1 memory (and pids) hierarchies; or chown to this user the "
              "cgroup v1 memory (and pids) groups the run starts in; or, on cgroup v2, a group for the run whose "
              "memory and pids controllers are enabled for its children (cgroup.subtree_control), which the "
              "kernel allows only for the root group: a group delegated by systemd (Delegate=) is not enough yet")


class CgroupUnavailable(RuntimeError):
    """No cgroup can limit a sandbox here; the message says why and what the host needs."""


class SandboxCgroup:
    """One sandbox's groups: memory (always) and pids (where the controller exists).

    On cgroup v2 both controllers live in one directory; on v1 each has its own hierarchy, so a
    process joins by writing its pid to every file in `procs`.
    """

    def __init__(self, memory: Path, pids: Path | None, version: int):
        self.path, self.pids_path, self.version = memory, pids, version
        dirs = [memory] + ([pids] if pids is not None and pids != memory else [])
        self.dirs = tuple(dirs)
        self.procs = tuple(str(d / "cgroup.procs") for d in dirs)

    @property
    def kind(self) -> str:
        return f"cgroup v{self.version}" + (" (memory, pids)" if self.pids_path is not None else " (memory)")

    @classmethod
    def create(cls, owner_pid: int, tag: str, memory_bytes: int, max_processes: int) -> "SandboxCgroup":
        memory_parent, pids_parent, version = _parents()
        name = f"{PREFIX}{owner_pid}-{tag}"
        group = cls(memory_parent / name, None if pids_parent is None else pids_parent / name, version)
        made = []
        try:
            for d in group.dirs:
                d.mkdir()
                made.append(d)
            _set_memory(group.path, version, memory_bytes)
            if group.pids_path is not None:
                (group.pids_path / "pids.max").write_text(str(max_processes + PIDS_SLACK))
        except OSError as e:
            for d in made:
                _remove(d)
            raise CgroupUnavailable(f"cannot create the sandbox's cgroup {name} in {memory_parent} "
                                    f"({e.strerror}); the host needs: {HOST_NEEDS}") from None
        return group

    def join(self, pid: int) -> None:
        """Put `pid` (and so everything it starts) in the group; safe between fork and exec."""
        for p in self.procs:
            with open(p, "w") as f:
                f.write(str(pid))

    def oom_kills(self) -> int:
        """How many processes the kernel has killed in this group for exceeding its memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        return _field(self.path / name, "oom_kill")

    def refused_forks(self) -> int:
        """How many forks the process limit has refused (0 without a pids controller)."""
        if self.pids_path is None:
            return 0
        return _field(self.pids_path / "pids.events", "max")

    def peak_bytes(self) -> int | None:
        """The most memory the group has held (None where the kernel does not say)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        """Kill what is left in the group and delete it; never raises (a leftover is swept later)."""
        for d in self.dirs:
            _remove(d)


def sweep_stale() -> list[Path]:
    """Remove the groups of owners that no longer run (killed before they could clean up)."""
    try:
        memory_parent, pids_parent, _ = _parents()
    except CgroupUnavailable:
        return []
    removed = []
    for parent in {memory_parent, pids_parent} - {None}:
        for path in parent.glob(f"{PREFIX}*"):
            owner = path.name[len(PREFIX):].split("-", 1)[0]
            if owner.isdigit() and not owner_alive(int(owner)):
                _remove(path)
                removed.append(path)
    return removed


def _set_memory(path: Path, version: int, limit: int) -> None:
    if version == 2:
        (path / "memory.max").write_text(str(limit))
        if (path / "memory.swap.max").exists():
            (path / "memory.swap.max").write_text("0")
        return
    (path / "memory.limit_in_bytes").write_text(str(limit))
    memsw = path / "memory.memsw.limit_in_bytes"
    if memsw.exists():  # with swap accounting on, swap would otherwise extend the limit
        try:
            memsw.write_text(str(limit))
        except OSError:
            pass


def _parents() -> tuple[Path, Path | None, int]:
    """The directories new groups are made in (memory, pids or None), and the cgroup version."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as e:
        raise CgroupUnavailable(f"cannot read /proc/self/cgroup ({e.strerror})") from None
    entries = {}
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        entries[controllers] = rel
    # v2: the unified hierarchy, if it has the memory controller delegated to our group's children.
    unified = ROOT if (ROOT / "cgroup.controllers").exists() else ROOT / "unified"
    if "" in entries and (unified / "cgroup.controllers").exists():
        own = unified / entries[""].lstrip("/")
        if _delegate(own, "memory"):
            return own, (own if _delegate(own, "pids") else None), 2
    # v1: one hierarchy per controller.
    memory, pids = _v1_parent(entries, "memory"), _v1_parent(entries, "pids")
    if memory is not None:
        return memory, pids, 1
    raise CgroupUnavailable(f"no cgroup can hold this sandbox's processes (uid {os.geteuid()}): cgroup v2 has no "
                            "memory controller delegated to this process's group, and no cgroup v1 memory group "
                            f"is writable to it; the host needs: {HOST_NEEDS}")


def _v1_parent(entries: dict[str, str], controller: str) -> Path | None:
    for controllers, rel in entries.items():
        if controller in controllers.split(","):
            own = ROOT / controller / rel.lstrip("/")
            if own.is_dir() and os.access(own, os.W_OK):
                return own
    return None


def _delegate(own: Path, controller: str) -> bool:
    """Whether children of `own` get `controller`, enabling it where we may."""
    if controller in _words(own / "cgroup.subtree_control"):
        return True
    # Enabling a controller for children fails (EBUSY) in a non-root group that holds processes itself.
    if controller not in _words(own / "cgroup.controllers"):
        return False
    try:
        (own / "cgroup.subtree_control").write_text(f"+{controller}")
    except OSError:
        return False
    return True


def _field(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, value = line.partition(" ")
            if k == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def _remove(path: Path, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: processes still in it
            pass
        for pid in _words(path / "cgroup.procs"):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError, PermissionError):
                pass
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
