"""The rootless sandbox backend: user namespaces and bubblewrap, no privilege at all.

A sandbox is a *holder*: a process in a fresh user and mount namespace (made by `unshare` as the
unprivileged user) in which the working directory is a tmpfs of `disk_mb`, so the disk quota is a
real filesystem size, exactly as on the root backend. The host reaches that tmpfs through
/proc/<holder>/root. Each command enters the holder's namespaces (`nsenter`) and runs under `bwrap`
with every namespace new (user, PID, network, mount, IPC, UTS, cgroup):

- a read-only minimal root: /usr (with the /bin, /lib... links of a merged /usr), the few /etc files
  the dynamic linker and a shell need, `extra_ro_paths` if a task needs more, a private /proc,
  a /dev of a few devices, small private /tmp and /dev/shm, and the working directory. Nothing else
  of the host (its /etc/shadow, /home, /root, the project's checkout, /run and its sockets) exists;
- no network: the new network namespace holds only a downed loopback;
- limits: a cgroup (cgroup.py) holds all the sandbox's processes, with `memory_mb` for their memory
  together and `max_processes` for their number; where this process may make no such group (no
  root, no delegated cgroup), the sandbox refuses to start and says what the host needs, rather than
  cap memory per process only. Per command: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, and RLIMIT_NPROC,
  which is set *inside* the command's user namespace by `prlimit`, where the kernel counts only that
  namespace's processes (set outside, it would count every process of the user);
- cleanup: bwrap's PID 1 exits when the command does and takes the PID namespace with it, and it
  dies with bwrap (--die-with-parent), which the host kills at the wall-clock timeout. The holder
  exits when its owner does (`tail --pid`), which frees the tmpfs.

Started as root, the backend first drops to a throwaway uid, so the command is never host root and
its process count is its own (the kernel exempts uid 0 from RLIMIT_NPROC, even in a namespace).
Non-goals: asking systemd for a delegated cgroup itself, seccomp filters.
"""

from __future__ import annotations

import ctypes
import os
import resource
import secrets
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from miles.owners import alive as owner_alive
from miles.rollout.environments import cgroup
from miles.rollout.environments.cgroup import CgroupUnavailable, SandboxCgroup
from miles.rollout.environments.workdir import SandboxUnavailable, WorkDir, tmpfs_options

INNER_WORKDIR = "/var/tmp/work"
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
# What of the host a command sees besides /usr, all read-only: the merged-/usr links (or the
# directories, where /usr is not merged) and the /etc files that the dynamic linker and python need.
LINK_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "nsswitch.conf")
TOKEN_VAR = "MILES_SANDBOX_TOKEN"
# Kernel settings that turn unprivileged user namespaces off, and the value that does it.
USERNS_KNOBS = (("/proc/sys/kernel/unprivileged_userns_clone", "0"), ("/proc/sys/user/max_user_namespaces", "0"),
                ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1"))
# The host-side mount point of a holder's tmpfs, named after the owner so a dead owner's is swept.
HOST_DIR_PREFIX = "miles-sandbox-rootless-"
_TOOLS = ("bwrap", "unshare", "nsenter", "prlimit", "tail")
_PR_SET_PDEATHSIG = 1
_HOLDER_START_S = 30.0
# In the holder's namespaces: mount the working directory's tmpfs, say so, then live as long as the owner.
_HOLD = ('mount -t tmpfs -o "$2" miles-sandbox-work "$1" || exit 1; echo ready; '
         'exec tail --pid="$3" -f /dev/null >/dev/null 2>&1')


def probe() -> str:
    """Why this machine cannot run the rootless backend ("" when it can); it runs one real command."""
    hint = "; refusing to run terminal tasks unconfined"
    if os.name != "posix" or not Path("/proc/self/ns/user").exists():
        return "the rootless sandbox needs Linux user namespaces" + hint
    if shutil.which("bwrap", path=SAFE_PATH) is None:
        return ("the rootless sandbox needs bubblewrap: `bwrap` is not installed (run scripts/install-system.sh, "
                "or apt-get install bubblewrap)" + hint)
    missing = [t for t in _TOOLS if shutil.which(t, path=SAFE_PATH) is None]
    if missing:
        return f"the rootless sandbox needs {', '.join(missing)} (util-linux, coreutils) on PATH" + hint
    for knob, off in USERNS_KNOBS:
        try:
            value = Path(knob).read_text().strip()
        except OSError:
            continue
        if value == off:
            return (f"unprivileged user namespaces are disabled on this machine ({knob} = {value}); "
                    f"set it to {'1' if off == '0' else '0'} (sysctl), or use sandbox.backend = \"root\" as root"
                    + hint)
    try:
        with RootlessBackend(disk_mb=1, parent_dir=None, memory_mb=64, max_processes=8) as b:
            argv = b.argv("echo ok", max_processes=8)
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd="/",
                               env={"PATH": SAFE_PATH}, preexec_fn=b.preexec(cpu_time_s=10, memory_mb=512,
                                                                             max_file_mb=1))
    except SandboxUnavailable as e:
        return str(e) + hint
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"running a command under bwrap failed: {e}" + hint
    if r.returncode != 0 or r.stdout.strip() != "ok":
        return f"bwrap could not build the sandbox ({r.stderr.strip() or r.returncode})" + hint
    return ""


class RootlessBackend:
    """One sandbox's holder and working directory; `argv` builds each command's bwrap line."""

    def __init__(self, disk_mb: int, parent_dir: str | None, extra_ro_paths: tuple[str, ...] = (), *,
                 memory_mb: int, max_processes: int):
        self.extra_ro_paths = tuple(extra_ro_paths)
        self.token = secrets.token_hex(8)
        cgroup.sweep_stale()
        try:
            # Made with this process's own rights: as root, or in a group delegated to its user.
            self.cgroup = SandboxCgroup.create(os.getpid(), self.token, memory_mb << 20, max_processes)
        except CgroupUnavailable as e:
            raise SandboxUnavailable(f"the rootless sandbox limits memory_mb and max_processes for all of a "
                                     f"sandbox's processes together, with a cgroup: {e}") from None
        try:
            self._start(disk_mb, parent_dir)
        except BaseException:
            self.cgroup.remove()
            raise

    def _start(self, disk_mb: int, parent_dir: str | None) -> None:
        """The holder, and the working directory mounted in its user namespace."""
        if os.geteuid() == 0:
            self.uid = self.gid = 200_000 + secrets.randbelow(1_000_000_000)
            _require_traversable(Path(parent_dir or tempfile.gettempdir()))
        else:
            self.uid, self.gid = os.getuid(), os.getgid()
        sweep_stale(parent_dir)
        self._host_dir = Path(tempfile.mkdtemp(prefix=f"{HOST_DIR_PREFIX}{os.getpid()}-", dir=parent_dir))
        if os.geteuid() == 0:
            os.chown(self._host_dir, self.uid, self.gid)
        try:
            self.holder = subprocess.Popen(
                ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private", "--",
                 "/bin/sh", "-c", _HOLD, "miles-sandbox-holder", str(self._host_dir),
                 tmpfs_options(disk_mb, 0, 0), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"PATH": SAFE_PATH},
                cwd="/", start_new_session=True, preexec_fn=self._as_sandbox_user)
        except OSError as e:
            os.rmdir(self._host_dir)
            raise SandboxUnavailable(f"starting the rootless sandbox's namespace holder failed: {e}") from None
        # A kernel that stalls here must not hang the episode: wait for "ready" a bounded time.
        ready = b""
        if select.select([self.holder.stdout], [], [], _HOLDER_START_S)[0]:
            ready = self.holder.stdout.readline()
        if ready.strip() != b"ready":
            self.holder.kill()
            err = self.holder.communicate()[1].decode(errors="replace").strip()
            os.rmdir(self._host_dir)
            raise SandboxUnavailable(f"the rootless sandbox could not mount its {disk_mb} MiB working directory "
                                     f"in a user namespace ({err or 'no reason given'})")
        self.holder.stdout.close()
        self.holder.stderr.close()
        inner = Path(f"/proc/{self.holder.pid}/root") / self._host_dir.relative_to("/")
        self.workdir = WorkDir(inner, self.uid, self.gid, self._host_dir, on_remove=self._stop_holder,
                               act_as_owner=True)

    def _as_sandbox_user(self) -> None:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(self.gid)
            os.setuid(self.uid)

    def argv(self, command: str, max_processes: int) -> list[str]:
        args = ["nsenter", f"--target={self.holder.pid}", "--user", "--mount", "--preserve-credentials", "--",
                "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
                "--uid", "1000", "--gid", "1000", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for d in LINK_DIRS:
            host = Path("/", d)
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), f"/{d}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{d}"]
        for name in ETC_FILES:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        for p in self.extra_ro_paths:
            args += ["--ro-bind", p, p]
        args += ["--proc", "/proc", "--dev", "/dev", "--size", str(4 << 20), "--tmpfs", "/tmp",
                 "--size", str(1 << 20), "--tmpfs", "/dev/shm", "--size", str(1 << 20), "--tmpfs", "/var/tmp",
                 "--bind", str(self._host_dir), INNER_WORKDIR, "--remount-ro", "/", "--chdir", INNER_WORKDIR,
                 "--clearenv"]
        for k, v in {"PATH": SAFE_PATH, "HOME": INNER_WORKDIR, "LANG": "C.UTF-8", "TERM": "dumb", "TMPDIR": "/tmp",
                     TOKEN_VAR: self.token}.items():
            args += ["--setenv", k, v]
        # bwrap's own PID 1 counts in the namespace too, hence the +1.
        n = max_processes + 1
        return args + ["--", "prlimit", f"--nproc={n}:{n}", "--", "/bin/sh", "-c", command]

    def preexec(self, cpu_time_s: int, memory_mb: int, max_file_mb: int):
        group = self.cgroup

        def apply():
            # In the child between fork and exec. The cgroup is joined with the owner's rights, before
            # the uid change; that change comes next, as it clears the parent-death signal, which
            # makes the command die with the host thread that started it.
            group.join(os.getpid())
            self._as_sandbox_user()
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_time_s, cpu_time_s + 1))
            mem = memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            fsize = max_file_mb << 20
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        return apply

    def processes(self) -> list[int]:
        """Host PIDs of the sandbox's commands still running, found by the token in their environment.

        A command that execs with a cleared environment hides from this count, not from cleanup: the
        end of its PID namespace kills it all the same."""
        marker = f"{TOKEN_VAR}={self.token}".encode()
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        out.append(int(entry.name))
                except OSError:
                    pass
        return out

    def kill_all(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _stop_holder(self) -> None:
        self.kill_all()
        try:
            self.holder.kill()
        except ProcessLookupError:
            pass
        self.holder.wait()

    def close(self) -> None:
        self.workdir.remove()
        self.cgroup.remove()

    def __enter__(self) -> "RootlessBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _require_traversable(folder: Path) -> None:
    # Started as root, the holder runs as a throwaway uid, which must be able to reach the mount point.
    for d in [folder.resolve(), *folder.resolve().parents]:
        if not d.stat().st_mode & stat.S_IXOTH:
            raise SandboxUnavailable(f"the rootless sandbox, started as root, runs as a throwaway uid that cannot "
                                     f"enter {d} (mode {stat.filemode(d.stat().st_mode)}): give it a parent_dir "
                                     "that every user may traverse (o+x), such as the default temp directory")


def sweep_stale(parent_dir: str | None) -> list[str]:
    """Remove the mount points that owners killed before their close() left in `parent_dir`.

    They are empty on the host (the files lived in the holder's tmpfs, which went with the holder
    when its owner died), so a plain rmdir is all it takes; one that is not empty is left alone.
    """
    removed = []
    for d in Path(parent_dir or tempfile.gettempdir()).glob(f"{HOST_DIR_PREFIX}*"):
        owner = d.name[len(HOST_DIR_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not owner_alive(int(owner)):
            try:
                d.rmdir()
                removed.append(str(d))
            except OSError:
                pass
    return removed


def await_gone(backend: RootlessBackend, timeout_s: float = 5.0) -> None:
    """Wait until the kernel has torn the command's PID namespace down, then kill any straggler."""
    deadline = time.monotonic() + timeout_s
    while backend.processes() and time.monotonic() < deadline:
        time.sleep(0.02)
    backend.kill_all()
