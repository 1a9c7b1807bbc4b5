"""A sandbox for the shell commands of terminal tasks.

Each command runs in fresh Linux namespaces (network, PID, mount) as an unprivileged user id that no
other sandbox shares, with its own working directory on the host:

- no network: a new network namespace holds only a downed loopback, so nothing (not even servers on
  the host's 127.0.0.1) can be reached;
- nowhere else to write: the command runs as a throwaway uid that owns only its working directory,
  and the world-writable places (/tmp, /var/tmp, /dev/shm) are replaced by tiny private tmpfs mounts;
- limits: CPU seconds, address space, file size and process count (RLIMIT_*; the process count is
  per uid, which is why every sandbox gets its own), a wall-clock timeout, and output truncated to a
  budget (a command that keeps printing far past it is stopped);
- cleanup: the command is PID 1 of its PID namespace's child, so when the command ends or is
  killed every process it left behind dies with the namespace; `close()` deletes the directory.

When the kernel or the privileges do not allow this (not root, no `unshare`/`setpriv`, namespaces
refused), the sandbox refuses to start with SandboxUnavailable rather than run anything unconfined.
Non-goals: seccomp syscall filtering, containers/images, persistent processes across commands.
"""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles.config import ConfigError

# Inside the namespaces the working directory is bind-mounted here; /var/tmp itself is a private tmpfs.
INNER_WORKDIR = "/var/tmp/work"
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

# Runs as root inside the new namespaces: hide the world-writable places, mount a private /proc,
# then drop to the sandbox uid for good. The user command is run by a non-exec'ing shell so that it is
# not PID 1 (PID 1 ignores default-action signals such as SIGXCPU).
_SETUP = (
    'set -e; W="$1"; U="$2"; C="$3"; '
    "mount -t tmpfs -o size=1m,mode=0755 miles-sandbox /var/tmp; mkdir /var/tmp/work; "
    f'mount --bind "$W" {INNER_WORKDIR}; '
    "mount -t tmpfs -o size=4m,mode=1777 miles-sandbox /tmp; "
    "mount -t tmpfs -o size=1m,mode=0755 miles-sandbox /dev/shm; "
    "mount -t proc proc /proc; "
    f"cd {INNER_WORKDIR}; "
    'exec setpriv --reuid="$U" --regid="$U" --clear-groups --no-new-privs --inh-caps=-all '
    '--bounding-set=-all -- /bin/sh -c \'/bin/sh -c "$1"; exit $?\' sandbox "$C"'
)


class SandboxUnavailable(RuntimeError):
    """This machine cannot confine a command; nothing was run."""


class SandboxError(ValueError):
    """A request to the sandbox itself was refused (e.g. a path outside its directory)."""


@dataclass
class SandboxConfig:
    cpu_time_s: int = 10
    """CPU seconds per command (RLIMIT_CPU); past it the command gets SIGXCPU, then SIGKILL."""
    memory_mb: int = 1024
    """Address-space limit per process in MiB (RLIMIT_AS)."""
    max_file_mb: int = 16
    """Largest file a command may write, in MiB (RLIMIT_FSIZE)."""
    max_processes: int = 64
    """Most processes the command may have at once (RLIMIT_NPROC, per sandbox uid)."""
    wall_timeout_s: float = 20.0
    """Wall-clock seconds per command; then every process of the command is killed."""
    max_output_bytes: int = 8192
    """Output kept per stream; the rest is dropped and the result says truncated."""
    stop_after_output_factor: int = 16
    """Stop a command once it has printed this many times max_output_bytes (it is only wasting time)."""

    def validate(self) -> None:
        if min(self.cpu_time_s, self.memory_mb, self.max_file_mb, self.max_processes, self.max_output_bytes) < 1:
            raise ConfigError("sandbox limits (cpu_time_s, memory_mb, max_file_mb, max_processes, "
                              "max_output_bytes) must all be >= 1")
        if self.wall_timeout_s <= 0:
            raise ConfigError("sandbox.wall_timeout_s must be > 0")
        if self.stop_after_output_factor < 1:
            raise ConfigError("sandbox.stop_after_output_factor must be >= 1")


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
_probe_result: str | None = None  # None = not probed; "" = works; otherwise why not


def check_available() -> None:
    """Raise SandboxUnavailable unless this process can build the sandbox (probed once per process)."""
    global _probe_result
    with _probe_lock:
        if _probe_result is None:
            _probe_result = _probe()
    if _probe_result:
        raise SandboxUnavailable(_probe_result)


def _probe() -> str:
    hint = "; refusing to run terminal tasks unconfined"
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "the sandbox needs Linux namespaces" + hint
    if os.geteuid() != 0:
        return ("the sandbox needs root (to create network/PID/mount namespaces and switch to a throwaway uid); "
                "run as root or in a container that grants CAP_SYS_ADMIN" + hint)
    missing = [b for b in ("unshare", "setpriv", "mount") if shutil.which(b) is None]
    if missing:
        return f"the sandbox needs {', '.join(missing)} (util-linux) on PATH" + hint
    try:
        r = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount", "--propagation", "private", "true"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"creating namespaces failed: {e}" + hint
    if r.returncode != 0:
        return f"the kernel refused new namespaces ({r.stderr.strip() or r.returncode})" + hint
    return ""


class Sandbox:
    """One task's sandbox: a private working directory and a uid; commands run one at a time.

    Use as a context manager, or call close(); the directory and everything in it is deleted.
    """

    def __init__(self, config: SandboxConfig | None = None, parent_dir: str | None = None):
        check_available()
        self.config = config or SandboxConfig()
        # A uid nobody else uses: RLIMIT_NPROC counts per uid, and it owns nothing outside the directory.
        self.uid = 200_000 + secrets.randbelow(1_000_000_000)
        self.workdir = Path(tempfile.mkdtemp(prefix="miles-sandbox-", dir=parent_dir))
        os.chown(self.workdir, self.uid, self.uid)
        os.chmod(self.workdir, 0o700)
        self._closed = False
        self._lock = threading.Lock()

    # ---- files, from the host side (task setup and inspection) ---------------------------------

    def _host_path(self, rel: str) -> Path:
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise SandboxError(f"path {rel!r}: give a relative path inside the sandbox directory, without '..'")
        host = self.workdir / p
        # A command may have planted a symlink pointing out; resolve and re-check before touching it as root.
        if not str(host.resolve()).startswith(str(self.workdir.resolve()) + os.sep):
            raise SandboxError(f"path {rel!r} leads outside the sandbox directory (a symlink?); refused")
        return host

    def write_file(self, rel: str, content: str | bytes, mode: int = 0o644) -> None:
        host = self._host_path(rel)
        host.parent.mkdir(parents=True, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        for d in [host, *host.relative_to(self.workdir).parents]:
            os.lchown(self.workdir / d, self.uid, self.uid)

    def read_file(self, rel: str, max_bytes: int = 1 << 20) -> str | None:
        """The file's text (None if it does not exist); symlinks are not followed."""
        host = self._host_path(rel)
        try:
            fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW)
        except (FileNotFoundError, OSError):
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(max_bytes).decode(errors="replace")

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

    def _limits(self):
        c = self.config

        def apply():
            resource.setrlimit(resource.RLIMIT_CPU, (c.cpu_time_s, c.cpu_time_s + 1))
            mem = c.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            fsize = c.max_file_mb << 20
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_NPROC, (c.max_processes, c.max_processes))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        return apply

    def _run(self, command: str, timeout_s: float) -> CommandResult:
        c = self.config
        argv = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private",
                "--", "/bin/sh", "-c", _SETUP, "sandbox-setup", str(self.workdir), str(self.uid), command]
        env = {"PATH": _SAFE_PATH, "HOME": INNER_WORKDIR, "LANG": "C.UTF-8", "TERM": "dumb", "TMPDIR": "/tmp"}
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, cwd="/", start_new_session=True, preexec_fn=self._limits())
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
            _await_gone(self.uid)
        elapsed = time.monotonic() - t0
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        violations = []
        if timed_out:
            violations.append(f"wall-clock timeout after {timeout_s:g}s: killed")
        if flood.is_set():
            violations.append(f"output flood: stopped after {stop_at} bytes")
        if not timed_out and not flood.is_set() and code > 128 and (code - 128) in _SIGNAL_VIOLATIONS:
            violations.append(_SIGNAL_VIOLATIONS[code - 128])
        truncated = any(s.dropped for s in streams.values())
        if truncated:
            violations.append(f"output truncated to {cap} bytes per stream")
        return CommandResult(command=command, exit_code=code, stdout=streams["stdout"].text(),
                             stderr=streams["stderr"].text(), elapsed_s=elapsed, truncated=truncated,
                             timed_out=timed_out, violations=tuple(violations))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _kill_uid(self.uid)  # belt and braces: the PID namespace should already have taken them all
        shutil.rmtree(self.workdir, ignore_errors=True)

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
