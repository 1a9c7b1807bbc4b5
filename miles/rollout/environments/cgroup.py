"""A memory cgroup per sandbox: one limit for all of a sandbox's processes together.

RLIMIT_AS caps each process on its own, so a command that forks N children may use N times the
limit; a memory cgroup caps their sum, and the kernel's OOM killer acts inside the group only.
cgroup v2 (`memory.max`) is used where the memory controller is delegated to this process's cgroup;
otherwise the v1 memory hierarchy (`memory.limit_in_bytes`). Each group is a child of the cgroup this
process runs in, named `miles-sandbox-<owner pid>-<uid>`, so groups a killed owner left behind are
found and removed by the next sandbox (`sweep_stale`).

Non-goals: CPU, IO or pid controllers (the sandbox keeps RLIMIT_CPU and RLIMIT_NPROC for those),
systemd delegation, rootless cgroups.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from miles.owners import alive as owner_alive

ROOT = Path("/sys/fs/cgroup")
PREFIX = "miles-sandbox-"


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here; the message says why."""


class MemoryCgroup:
    """One sandbox's memory cgroup. `procs` is the file a process writes its pid to to join."""

    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version
        self.procs = path / "cgroup.procs"

    @property
    def kind(self) -> str:
        return f"cgroup v{self.version}"

    @classmethod
    def create(cls, owner_pid: int, uid: int, limit_bytes: int) -> "MemoryCgroup":
        parent, version = _memory_parent()
        path = parent / f"{PREFIX}{owner_pid}-{uid}"
        try:
            path.mkdir()
        except OSError as e:
            raise CgroupUnavailable(f"cannot create {path} ({e.strerror})") from None
        group = cls(path, version)
        try:
            if version == 2:
                (path / "memory.max").write_text(str(limit_bytes))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                memsw = path / "memory.memsw.limit_in_bytes"
                if memsw.exists():  # with swap accounting on, swap would otherwise extend the limit
                    try:
                        memsw.write_text(str(limit_bytes))
                    except OSError:
                        pass
        except OSError as e:
            group.remove()
            raise CgroupUnavailable(f"cannot set the memory limit of {path} ({e.strerror})") from None
        return group

    def oom_kills(self) -> int:
        """How many processes the kernel has killed in this group for exceeding its limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def peak_bytes(self) -> int | None:
        """The most memory the group has held (None where the kernel does not say)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        """Kill what is left in the group and delete it; never raises (a leftover is swept later)."""
        _remove(self.path)


def sweep_stale() -> list[Path]:
    """Remove the groups of owners that no longer run (killed before they could clean up)."""
    try:
        parent, _ = _memory_parent()
    except CgroupUnavailable:
        return []
    removed = []
    for path in parent.glob(f"{PREFIX}*"):
        owner = path.name[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not owner_alive(int(owner)):
            _remove(path)
            removed.append(path)
    return removed


def _memory_parent() -> tuple[Path, int]:
    """The cgroup directory new groups are made in, and the cgroup version."""
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
        if "memory" in _words(own / "cgroup.subtree_control") or _delegate_memory(own):
            return own, 2
    # v1: the memory hierarchy.
    for controllers, rel in entries.items():
        if "memory" in controllers.split(","):
            own = ROOT / "memory" / rel.lstrip("/")
            if own.is_dir() and os.access(own, os.W_OK):
                return own, 1
    raise CgroupUnavailable("no writable memory cgroup: neither cgroup v2 with the memory controller delegated "
                            "nor a cgroup v1 memory hierarchy is available to this process")


def _delegate_memory(own: Path) -> bool:
    # Enabling a controller for children fails (EBUSY) in a non-root group that holds processes itself.
    if "memory" not in _words(own / "cgroup.controllers"):
        return False
    try:
        (own / "cgroup.subtree_control").write_text("+memory")
    except OSError:
        return False
    return True


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
            except (ProcessLookupError, ValueError):
                pass
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
