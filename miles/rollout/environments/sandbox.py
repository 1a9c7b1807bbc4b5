"""A sandbox for the shell commands of terminal tasks, on one of two backends.

`sandbox.backend` picks how commands are confined: "root" (below; needs root), "rootless" (user
namespaces and bubblewrap, rootless.py; needs no privilege, but a cgroup it may write), or "auto"
(root when this process is root and the root backend works here, rootless otherwise). Both give the
same guarantees; the escape-attempt suite (tests/unit/rollout/environments/test_sandbox_escapes.py)
runs against each.

On the root backend each command runs in fresh Linux namespaces (network, PID, mount) as an
unprivileged user id that no other sandbox shares, with its own working directory (workdir.py):

- no network: a new network namespace holds only a downed loopback, so nothing (not even servers on
  the host's loopback interface, nor abstract unix sockets) can be reached;
- a minimal root: the command's / is a fresh tmpfs holding read-only binds of /usr, /bin, /sbin,
  /lib*, the dynamic linker's few /etc files and `extra_ro_paths`, a private /proc, a /dev of a few
  character devices, small private /tmp, /var/tmp and /dev/shm, and the working directory. Nothing
  else of the host's filesystem (/etc/passwd, /run, /home, /root, /sys, the project's checkout, the
  host's /tmp, and every unix socket in them) exists inside;
- nowhere else to write: the command runs as a throwaway uid that owns only its working directory;
- limits: the working directory is a tmpfs of `disk_mb` (the disk quota); all the sandbox's processes
  together live in one cgroup of `memory_mb` and `max_processes` (cgroup.py); CPU seconds, per-process
  address space, file size and process count (RLIMIT_*; the process count is per uid, which is why
  every sandbox gets its own); a wall-clock timeout; output truncated to a budget (a command that keeps
  printing far past it is stopped);
- cleanup: the command runs in its own PID namespace, so when it ends or is killed every process it
  left behind dies with the namespace (and with the host process, through PR_SET_PDEATHSIG);
  `close()` removes the cgroup and unmounts the working directory, and cannot fail.

When the kernel or the privileges do not allow the chosen backend (root: not root, no
`unshare`/`setpriv`/`pivot_root`, namespaces refused, no writable memory cgroup, no tmpfs mount;
rootless: no `bwrap`, user namespaces disabled, no cgroup this user may write), the sandbox refuses
to start with SandboxUnavailable, naming what is missing (and, for the cgroup, what the host needs),
rather than run anything unconfined or cap memory per process only. The limits are SandboxConfig
(rollout.agent.sandbox, in rollout/config.py with the rest of the rollout section).
Non-goals: seccomp syscall filtering, containers/images, persistent processes across commands.
"""

from __future__ import annotations

import ctypes
import os
import resource
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from miles.rollout.config import SANDBOX_BACKENDS, SandboxConfig
from miles.rollout.environments import cgroup, rootless, workdir
from miles.rollout.environments.cgroup import CgroupUnavailable, SandboxCgroup
from miles.rollout.environments.rootless import INNER_WORKDIR, RootlessBackend
from miles.rollout.environments.workdir import SandboxError, SandboxUnavailable, WorkDir, WorkDirUnavailable

_SAFE_PATH = rootless.SAFE_PATH
BACKENDS = SANDBOX_BACKENDS

# What of the host a command sees, read-only, as on the rootless backend: /usr and its merged links
# (or directories), the few /etc files the dynamic linker and a shell need, and `extra_ro_paths`.
# Everything else of the host's filesystem (/etc/passwd, /root, /home, the project's checkout, the
# host's /tmp) is absent.
ROOT_DIRS = ("usr",) + rootless.LINK_DIRS
DEVICES = ("null", "zero", "full", "random", "urandom")

# Runs as root inside the new namespaces: build a new root on a private tmpfs (read-only binds of
# ROOT_DIRS, the /etc files and the extra paths given after the command, a few devices, private /tmp,
# /var/tmp, /dev/shm and /proc, the working directory),
# pivot into it, then run the command as the sandbox uid. This shell stays PID 1, as root: a process
# that changes its uid loses its parent-death signal, and PID 1's is what takes the namespace down
# when unshare dies (--kill-child). The command is thus never PID 1, which would ignore
# default-action signals such as SIGXCPU.
_SETUP = (
    'set -e; PATH="$PATH:/usr/sbin:/sbin"; W="$1"; U="$2"; C="$3"; shift 3; '
    "mount -t tmpfs -o size=1m,mode=0755 miles-sandbox /var/tmp; R=/var/tmp/root; mkdir $R; "
    "mount -t tmpfs -o size=1m,mode=0755 miles-sandbox-root $R; "
    'ro() { if [ -d "$1" ]; then mkdir -p "$R$1"; else mkdir -p "$(dirname "$R$1")"; touch "$R$1"; fi; '
    '  mount --bind "$1" "$R$1"; mount -o remount,bind,ro,nosuid,nodev "$R$1"; }; '
    f"for d in {' '.join(ROOT_DIRS)}; do "
    '  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$R/$d"; elif [ -d "/$d" ]; then ro "/$d"; fi; '
    "done; "
    f'mkdir $R/etc; for f in {" ".join(rootless.ETC_FILES)}; do if [ -e "/etc/$f" ]; then ro "/etc/$f"; fi; done; '
    "mkdir $R/dev $R/proc $R/tmp $R/var; mount -t tmpfs -o size=64k,mode=0755 miles-sandbox $R/dev; "
    f"for n in {' '.join(DEVICES)}; do touch $R/dev/$n; mount --bind /dev/$n $R/dev/$n; done; "
    "ln -s /proc/self/fd $R/dev/fd; for i in 0 1 2; do ln -s /proc/self/fd/$i $R/dev/$i; done; "
    "ln -s 0 $R/dev/stdin; ln -s 1 $R/dev/stdout; ln -s 2 $R/dev/stderr; "
    "mkdir $R/dev/shm; mount -t tmpfs -o size=1m,mode=1777,nosuid,nodev miles-sandbox $R/dev/shm; "
    "mount -t tmpfs -o size=4m,mode=1777,nosuid,nodev miles-sandbox $R/tmp; "
    "mkdir $R/var/tmp; mount -t tmpfs -o size=1m,mode=0755,nosuid,nodev miles-sandbox $R/var/tmp; "
    'for p in "$@"; do ro "$p"; done; '
    f'mkdir $R{INNER_WORKDIR}; mount --bind "$W" $R{INNER_WORKDIR}; '
    "mount -t proc -o nosuid,nodev,noexec proc $R/proc; "
    "cd $R; pivot_root . .; umount -l .; "
    f"cd {INNER_WORKDIR}; "
    'setpriv --reuid="$U" --regid="$U" --clear-groups --no-new-privs --inh-caps=-all '
    '--bounding-set=-all -- /bin/sh -c \'/bin/sh -c "$1"; exit $?\' sandbox "$C"; exit $?'
)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class CommandResult:
    command: str
    exit_code: int          # the command's exit status; 128+N when signal N ended it
    stdout: str
    stderr: str
    elapsed_s: float
    truncated: bool = False  # some output was dropped
    timed_out: bool = False  # the wall-clock timeout killed it
    violations: tuple[str, ...] = field(default_factory=tuple)  # limits the command ran into

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def observation(self) -> str:
        """What an agent is shown: output, then a line per limit hit and the exit status."""
        parts = [self.stdout, self.stderr]
        notes = [f"[{v}]" for v in self.violations]
        if self.exit_code != 0 and not self.timed_out:
            notes.append(f"[exit status {self.exit_code}]")
        text = "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts)
        return text + ("\n".join(notes) + "\n" if notes else "")


_SIGNAL_VIOLATIONS = {
    signal.SIGXCPU: "cpu time limit exceeded",
    signal.SIGXFSZ: "file size limit exceeded",
}

_probe_lock = threading.Lock()
_probe_results: dict[str, str] = {}  # backend -> "" (works) or why not; probed once per process


def check_available(backend: str = "auto") -> str:
    """The backend commands will run on ("root" or "rootless"); SandboxUnavailable, naming what is
    missing, when `backend` cannot confine a command on this machine."""
    if backend not in BACKENDS:
        raise SandboxError(f"sandbox backend {backend!r}: write one of {', '.join(map(repr, BACKENDS))}")
    if backend == "auto":
        if os.geteuid() == 0 and not _probed("root"):
            return "root"
        if not _probed("rootless"):
            return "rootless"
        reasons = [f"rootless: {_probed('rootless')}"]
        if os.geteuid() == 0:
            reasons.insert(0, f"root: {_probed('root')}")
        raise SandboxUnavailable("no sandbox backend works here; " + " | ".join(reasons))
    why = _probed(backend)
    if why:
        raise SandboxUnavailable(why)
    return backend


def _probed(backend: str) -> str:
    with _probe_lock:
        if backend not in _probe_results:
            _probe_results[backend] = _probe() if backend == "root" else rootless.probe()
        return _probe_results[backend]


def _probe() -> str:
    hint = "; refusing to run terminal tasks unconfined"
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "the sandbox needs Linux namespaces" + hint
    if os.geteuid() != 0:
        return ("the root sandbox backend needs root (to create network/PID/mount namespaces and switch to a "
                "throwaway uid); run as root, or use sandbox.backend = \"rootless\"" + hint)
    missing = [b for b in ("unshare", "setpriv", "mount", "pivot_root")
               if shutil.which(b, path=f"{_SAFE_PATH}:/usr/sbin:/sbin") is None]
    if missing:
        return f"the sandbox needs {', '.join(missing)} (util-linux) on PATH" + hint
    try:
        r = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount", "--propagation", "private", "--cgroup",
                            "true"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"creating namespaces failed: {e}" + hint
    if r.returncode != 0:
        return f"the kernel refused new namespaces ({r.stderr.strip() or r.returncode})" + hint
    try:
        SandboxCgroup.create(os.getpid(), "probe", 64 << 20, 8).remove()
    except CgroupUnavailable as e:
        return f"the sandbox needs a cgroup to limit the memory of all its processes together: {e}" + hint
    return ""


class SandboxBackend(Protocol):
    """How one sandbox confines its commands; Sandbox runs them and captures their output."""

    workdir: WorkDir
    uid: int                   # the host uid its commands run as
    cgroup: SandboxCgroup

    def argv(self, command: str) -> list[str]:
        """The host command line that runs `command` confined."""

    def preexec(self) -> Callable[[], None]:
        """What the child runs between fork and exec (limits, parent-death signal, uid)."""

    def oom_kills(self) -> int:
        """Processes the sandbox's memory limit has killed so far."""

    def processes(self) -> list[int]:
        """Host PIDs of its commands still running."""

    def await_gone(self) -> None:
        """After a kill: wait until every process of the command is gone."""

    def close(self) -> None:
        """Kill what is left and remove the working directory; never raises."""


class _Root:
    """One root-backend sandbox: a throwaway uid, a tmpfs working directory on the host, a cgroup."""

    def __init__(self, config: SandboxConfig, parent_dir: str | None):
        self.config = config
        # What owners killed before their close() left behind (their pid is in the names).
        workdir.sweep_stale()
        cgroup.sweep_stale()
        # A uid nobody else uses: RLIMIT_NPROC counts per uid, and it owns nothing outside the directory.
        self.uid = 200_000 + secrets.randbelow(1_000_000_000)
        try:
            self.workdir = WorkDir.tmpfs(self.uid, config.disk_mb, parent_dir)
        except WorkDirUnavailable as e:
            raise SandboxUnavailable(f"the sandbox's working directory: {e}") from None
        try:
            self.cgroup = SandboxCgroup.create(os.getpid(), str(self.uid), config.memory_mb << 20,
                                               config.max_processes)
        except CgroupUnavailable as e:
            self.workdir.remove()
            raise SandboxUnavailable(f"the sandbox's cgroup: {e}") from None

    def argv(self, command: str) -> list[str]:
        # --cgroup: inside, the sandbox's cgroup is the root, so the host's cgroup paths do not show.
        return ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private",
                "--cgroup", "--", "/bin/sh", "-c", _SETUP, "sandbox-setup", str(self.workdir.path), str(self.uid),
                command, *self.config.extra_ro_paths]

    def preexec(self):
        c = self.config
        group = self.cgroup

        def apply():
            # In the child between fork and exec: join the sandbox's cgroup (everything the command
            # starts inherits it), and die with the host thread that started it.
            group.join(os.getpid())
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            resource.setrlimit(resource.RLIMIT_CPU, (c.cpu_time_s, c.cpu_time_s + 1))
            mem = c.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            fsize = c.max_file_mb << 20
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_NPROC, (c.max_processes, c.max_processes))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        return apply

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills()

    def processes(self) -> list[int]:
        return processes_of(self.uid)

    def await_gone(self) -> None:
        _await_gone(self.uid)

    def close(self) -> None:
        try:
            _kill_uid(self.uid)  # belt and braces: the PID namespace should already have taken them all
        except OSError:
            pass
        self.cgroup.remove()
        self.workdir.remove()


class _Rootless:
    """The rootless backend (rootless.py) behind the interface Sandbox uses."""

    def __init__(self, config: SandboxConfig, parent_dir: str | None):
        self.config = config
        self._b = RootlessBackend(config.disk_mb, parent_dir, tuple(config.extra_ro_paths),
                                  memory_mb=config.memory_mb, max_processes=config.max_processes)
        self.workdir, self.uid, self.cgroup = self._b.workdir, self._b.uid, self._b.cgroup

    def argv(self, command: str) -> list[str]:
        return self._b.argv(command, self.config.max_processes)

    def preexec(self):
        c = self.config
        return self._b.preexec(c.cpu_time_s, c.memory_mb, c.max_file_mb)

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills()

    def processes(self) -> list[int]:
        return self._b.processes()

    def await_gone(self) -> None:
        rootless.await_gone(self._b)

    def close(self) -> None:
        self._b.close()


BACKEND_CLASSES: dict[str, type[SandboxBackend]] = {"root": _Root, "rootless": _Rootless}


class Sandbox:
    """One task's sandbox: a private working directory and a uid; commands run one at a time.

    Use as a context manager, or call close(); the directory and everything in it is deleted.
    `backend` says which backend confines it ("root" or "rootless").
    """

    def __init__(self, config: SandboxConfig | None = None, parent_dir: str | None = None):
        self.config = config or SandboxConfig()
        self._closed = True  # until everything below exists, close() has nothing to undo
        self.backend = check_available(self.config.backend)
        self._backend: SandboxBackend = BACKEND_CLASSES[self.backend](self.config, parent_dir)
        self._dir = self._backend.workdir
        self.uid = self._backend.uid
        self.cgroup = self._backend.cgroup
        self.workdir = self._dir.path
        self._closed = False
        self._lock = threading.Lock()

    # ---- files, from the host side (task setup and inspection) ---------------------------------

    def write_file(self, rel: str, content: str | bytes, mode: int = 0o644) -> None:
        """Create or replace a regular file; anything else at that path (FIFO, socket, directory,
        symlink, or a path through a symlink) is refused with SandboxError."""
        self._dir.write_file(rel, content, mode)

    def read_file(self, rel: str, max_bytes: int = 1 << 20) -> str | None:
        """The file's text (None if it does not exist); a symlink, FIFO, socket or directory is refused
        with SandboxError."""
        return self._dir.read_file(rel, max_bytes)

    def processes(self) -> list[int]:
        """Host PIDs of this sandbox's commands still running; empty between commands."""
        return self._backend.processes()

    # ---- commands --------------------------------------------------------------------------------

    def run(self, command: str, timeout_s: float | None = None) -> CommandResult:
        if self._closed:
            raise SandboxError("this sandbox is closed; start a new one")
        if not isinstance(command, str) or not command.strip():
            raise SandboxError("command: give a non-empty shell command string")
        if "\x00" in command:
            raise SandboxError("command: contains a NUL byte, which no shell command can")
        with self._lock:
            return self._run(command, self.config.wall_timeout_s if timeout_s is None else timeout_s)

    def _run(self, command: str, timeout_s: float) -> CommandResult:
        c = self.config
        env = {"PATH": _SAFE_PATH, "HOME": INNER_WORKDIR, "LANG": "C.UTF-8", "TERM": "dumb", "TMPDIR": "/tmp"}
        oom_before = self._backend.oom_kills()
        t0 = time.monotonic()
        proc = subprocess.Popen(self._backend.argv(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd="/", start_new_session=True,
                                preexec_fn=self._backend.preexec())
        cap, stop_at = c.max_output_bytes, c.max_output_bytes * c.stop_after_output_factor
        streams = {"stdout": _Capture(cap), "stderr": _Capture(cap)}
        flood = threading.Event()
        readers = [threading.Thread(target=cap_.drain, args=(getattr(proc, name), stop_at, flood), daemon=True)
                   for name, cap_ in streams.items()]
        for r in readers:
            r.start()
        timed_out = False
        deadline = t0 + timeout_s
        while proc.poll() is None:
            if flood.is_set() or time.monotonic() > deadline:
                timed_out = not flood.is_set()
                _kill(proc)
                break
            time.sleep(0.01)
        proc.wait()
        for r in readers:
            r.join(timeout=5)
        if timed_out or flood.is_set():
            self._backend.await_gone()
        elapsed = time.monotonic() - t0
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        violations = []
        if timed_out:
            violations.append(f"wall-clock timeout after {timeout_s:g}s: killed")
        if flood.is_set():
            violations.append(f"output flood: stopped after {stop_at} bytes")
        if not timed_out and not flood.is_set() and code > 128 and (code - 128) in _SIGNAL_VIOLATIONS:
            violations.append(_SIGNAL_VIOLATIONS[code - 128])
        if self._backend.oom_kills() > oom_before:
            violations.append(f"memory limit exceeded ({c.memory_mb} MiB for the whole sandbox): "
                              "processes were killed")
        truncated = any(s.dropped for s in streams.values())
        if truncated:
            violations.append(f"output truncated to {cap} bytes per stream")
        return CommandResult(command=command, exit_code=code, stdout=streams["stdout"].text(),
                             stderr=streams["stderr"].text(), elapsed_s=elapsed, truncated=truncated,
                             timed_out=timed_out, violations=tuple(violations))

    def close(self) -> None:
        """Kill what is left, remove the cgroup, unmount and delete the directory; never raises."""
        if self._closed:
            return
        self._closed = True
        self._backend.close()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()


class _Capture:
    def __init__(self, cap: int):
        self.cap, self.buf, self.total, self.dropped = cap, bytearray(), 0, False

    def drain(self, pipe, stop_at: int, flood: threading.Event) -> None:
        # Keep reading past the cap so the command never blocks on a full pipe; only the head is kept.
        for chunk in iter(lambda: pipe.read1(65536), b""):
            self.total += len(chunk)
            room = self.cap - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
            if len(chunk) > max(room, 0):
                self.dropped = True
            if self.total > stop_at:
                flood.set()
        pipe.close()

    def text(self) -> str:
        return self.buf.decode(errors="replace")


def _kill(proc: subprocess.Popen) -> None:
    # unshare was started with --kill-child: its death takes the PID namespace and everything in it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _await_gone(uid: int, timeout_s: float = 5.0) -> None:
    # The kernel tears a dead PID namespace down asynchronously; wait so the next command starts clean.
    deadline = time.monotonic() + timeout_s
    while processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.02)
    _kill_uid(uid)


def _kill_uid(uid: int) -> None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid:
                os.kill(int(entry.name), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass


def processes_of(uid: int) -> list[int]:
    """PIDs (host view) still running as `uid`; the tests use it to prove cleanup."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    out.append(int(entry.name))
            except FileNotFoundError:
                pass
    return out
