"""Escape attempts a hostile command could make, against both sandbox backends.

Each case runs the sandbox in a child process: as root for the root backend, and for the rootless
backend as uid 65534 with no capabilities (the child imports as root, then drops every privilege
before it creates the sandbox), so "rootless" is tested the way an unprivileged user runs it. That
child first joins cgroup v1 groups handed to uid 65534, as an administrator delegates them to a user
(`delegated_cgroups`); without them the rootless sandbox refuses to start, which a test shows. The
host side (files outside, a listener on 127.0.0.1, the process table) is checked here, in the parent.
A backend this machine cannot run is skipped with the reason the sandbox itself gives.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import miles
import miles.rollout.environments.cgroup as cgroup_mod
import miles.rollout.environments.rootless as rootless_mod
import miles.rollout.environments.sandbox as sandbox_mod
from miles.config import ConfigError
from miles.rollout.environments.sandbox import Sandbox, SandboxConfig, SandboxError, SandboxUnavailable, check_available
from miles.rollout.environments.workdir import remove_tree

REPO = Path(__file__).resolve().parents[4]
NOBODY = 65534

_CHILD = r"""
import json, os, sys
from pathlib import Path
from miles.rollout.environments.sandbox import Sandbox, SandboxConfig, SandboxUnavailable, check_available
spec = json.loads(sys.argv[1])
for procs in spec["join"]:
    Path(procs).write_text(str(os.getpid()))
if spec["drop_to"] is not None:
    os.setgroups([])
    os.setgid(spec["drop_to"])
    os.setuid(spec["drop_to"])
try:
    check_available(spec["config"]["backend"])
except SandboxUnavailable as e:
    print(json.dumps({"unavailable": str(e), "euid": os.geteuid()}))
    sys.exit(0)
sb = Sandbox(SandboxConfig(**spec["config"]), parent_dir=spec["parent_dir"])
out = {"euid": os.geteuid(), "backend": sb.backend, "workdir": str(sb.workdir), "steps": []}
for step in spec["steps"]:
    r = sb.run(step["run"], step.get("timeout_s"))
    out["steps"].append({"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr, "timed_out": r.timed_out,
                         "violations": list(r.violations), "elapsed_s": r.elapsed_s, "processes": sb.processes(),
                         "workdir_bytes": sum(p.stat().st_size for p in Path(sb.workdir).iterdir() if p.is_file())})
out["cgroup"] = {"kind": sb.cgroup.kind, "peak_bytes": sb.cgroup.peak_bytes(), "oom_kills": sb.cgroup.oom_kills()}
sb.close()
out["processes_after_close"] = sb.processes()
print(json.dumps(out))
"""


@pytest.fixture(params=["root", "rootless"])
def backend(request):
    return request.param


@pytest.fixture
def parent_dir():
    """Where the sandbox's directory goes: a folder the unprivileged child owns."""
    d = Path(tempfile.mkdtemp(prefix="miles-escape-"))
    if os.geteuid() == 0:
        os.chown(d, NOBODY, NOBODY)
        d.chmod(0o755)  # a rootless sandbox started as root runs as a throwaway uid that must reach it
    yield d
    remove_tree(d)


@contextlib.contextmanager
def delegated_cgroups(uid: int, enabled: bool = True):
    """The cgroup.procs files of cgroup v1 memory and pids groups handed to `uid`, as an administrator
    delegates them (chown): a process that joins them and then runs as `uid` may make its sandboxes'
    groups inside. Empty where this process cannot make a memory group (not root, or no v1 hierarchy)."""
    made = {}
    if enabled and os.geteuid() == 0:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            for c in set(controllers.split(",")) & {"memory", "pids"}:
                d = cgroup_mod.ROOT / c / rel.lstrip("/") / f"miles-delegated-{os.getpid()}-{time.monotonic_ns()}"
                try:
                    d.mkdir()
                except OSError:
                    continue
                made[c] = d
                for p in (d, d / "cgroup.procs", d / "tasks"):
                    os.chown(p, uid, uid)
    try:
        yield [str(d / "cgroup.procs") for d in made.values()] if "memory" in made else []
    finally:
        for d in made.values():
            for sub in [p for p in d.iterdir() if p.is_dir()] + [d]:  # what a killed owner left, then the group
                cgroup_mod._remove(sub)


def child_report(backend: str, parent_dir: Path, *commands, timeout_s: float | None = None, delegate: bool = True,
                 **config) -> dict:
    """What the child (see _CHILD) reports after running `commands` in one sandbox of `backend`."""
    drop_to = NOBODY if backend == "rootless" and os.geteuid() == 0 else None
    steps = [{"run": c} if isinstance(c, str) else {"run": c[0], "timeout_s": c[1]} for c in commands]
    cfg = {"backend": backend, "wall_timeout_s": 10, "cpu_time_s": 5, "max_output_bytes": 4096,
           "max_processes": 32, "max_file_mb": 4, "memory_mb": 256, **config}
    with delegated_cgroups(NOBODY, enabled=drop_to is not None and delegate) as join:
        spec = {"drop_to": drop_to, "join": join, "config": cfg, "parent_dir": str(parent_dir), "steps": steps}
        r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True,
                           timeout=timeout_s or 60, cwd=str(parent_dir),
                           env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def confine(backend: str, parent_dir: Path, *commands, timeout_s: float | None = None, **config) -> dict:
    """Run `commands` in one sandbox of `backend` (each a string, or (command, timeout_s)); the child's report."""
    out = child_report(backend, parent_dir, *commands, timeout_s=timeout_s, **config)
    if "unavailable" in out:
        pytest.skip(f"the {backend} sandbox cannot run here as uid {out['euid']}: {out['unavailable']}")
    assert out["backend"] == backend
    if backend == "rootless":
        assert out["euid"] != 0  # the rootless sandbox really ran without root
    assert out["processes_after_close"] == []
    assert not Path(out["workdir"]).exists() and list(parent_dir.iterdir()) == []  # close() removed it all
    return out


def host_processes_with_cmdline(*argv: str) -> list[int]:
    want = ("\0".join(argv) + "\0").encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes() == want:
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_writes_outside_the_working_directory_do_not_land(backend, parent_dir):
    marker = f"miles-escape-{os.getpid()}-{backend}"
    targets = [Path("/tmp", marker), Path("/etc", marker), Path("/usr", marker), Path("/var/tmp", marker),
               Path("/dev/shm", marker), parent_dir / marker, REPO / marker, Path("/", marker)]
    cmd = "; ".join(f"echo x > {t}" for t in targets) + f"; echo x > ../{marker}; echo x > ../../{marker}; echo done"
    out = confine(backend, parent_dir, cmd)
    step = out["steps"][0]
    assert step["stdout"] == "done\n"
    for t in targets:
        assert not t.exists(), f"the {backend} sandbox wrote {t}"
    assert "Read-only file system" in step["stderr"] or "Permission denied" in step["stderr"]


def test_host_files_are_not_readable(backend, parent_dir):
    git = REPO / ".git"
    git_text = git.read_text() if git.is_file() else (git / "HEAD").read_text()
    shadow = Path("/etc/shadow").read_text() if os.access("/etc/shadow", os.R_OK) else None
    out = confine(backend, parent_dir,
                  f"cat {git} {git}/HEAD {git}/config; cat /etc/shadow; ls {REPO} /root /home /run /sys; "
                  "cat /proc/1/environ; echo done")
    step = out["steps"][0]
    assert step["stdout"].endswith("done\n")
    assert git_text.strip() not in step["stdout"]
    if shadow:
        assert shadow.splitlines()[0] not in step["stdout"]
    assert f"{REPO}" in step["stderr"] and "No such file or directory" in step["stderr"]
    # Nothing of /etc but what the linker needs is there at all.
    assert "cat: /etc/shadow: No such file or directory" in step["stderr"]


def test_fork_bomb_is_bounded_by_the_process_limit_and_leaves_nothing(backend, parent_dir):
    count_forks = ("python3 -c \"import os, time\nn = 0\ntry:\n    for _ in range(500):\n"
                   "        if os.fork() == 0:\n            time.sleep(5); os._exit(0)\n        n += 1\n"
                   "except OSError as e:\n    print(n, e.errno)\"")
    t0 = time.monotonic()
    out = confine(backend, parent_dir, count_forks, ("b(){ b | b & }; b; sleep 30", 2), "echo still usable",
                  max_processes=16)
    forks, bomb, after = out["steps"]
    assert len(forks["stdout"].split()) == 2, forks  # forks made, and the errno that stopped them
    n, err = forks["stdout"].split()
    assert int(n) < 16 and int(err) == 11  # EAGAIN: the process limit, not the timeout, stopped it
    # The bomb ends at the 2 s timeout, or sooner when its shell cannot fork any more; either way
    # within seconds, and with nothing left behind.
    assert (bomb["timed_out"] or bomb["exit_code"] != 0) and bomb["elapsed_s"] < 5, bomb
    assert bomb["processes"] == []
    assert after["stdout"] == "still usable\n"
    assert time.monotonic() - t0 < 15


def test_no_background_process_survives_the_command(backend, parent_dir):
    tag = str(900000 + os.getpid() % 1000)
    out = confine(backend, parent_dir,
                  f"(sleep {tag} &); nohup sleep {tag} >/dev/null 2>&1 & setsid sleep {tag} & "
                  "python3 -c \"import os\nif os.fork() == 0:\n    os.setsid()\n"
                  f"    os.execvp('sleep', ['sleep', '{tag}'])\"; "
                  "echo started", "echo next")
    first, nxt = out["steps"]
    assert first["stdout"] == "started\n" and not first["timed_out"] and first["elapsed_s"] < 5
    assert first["processes"] == [] and nxt["processes"] == []
    assert host_processes_with_cmdline("sleep", tag) == []


def test_cpu_file_size_memory_and_wall_clock_limits_hold(backend, parent_dir):
    out = confine(backend, parent_dir, "while :; do :; done", "head -c 5000000 /dev/zero > big",
                  "python3 -c 'x = bytearray(600 << 20)'", ("sleep 1000 & sleep 1000", 1),
                  cpu_time_s=1, max_file_mb=1, memory_mb=256)
    cpu, fsize, mem, wall = out["steps"]
    assert "cpu time limit exceeded" in cpu["violations"] and not cpu["timed_out"], cpu
    assert "file size limit exceeded" in fsize["violations"] and fsize["workdir_bytes"] == 1 << 20, fsize
    assert mem["exit_code"] != 0 and "MemoryError" in mem["stderr"]
    assert wall["timed_out"] and wall["elapsed_s"] < 5 and wall["processes"] == []


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1, like an engine's port; records whatever connects."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.1)
    accepted, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                accepted.append(srv.accept())
            except socket.timeout:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1], accepted
    done.set()
    t.join()
    srv.close()


def test_no_network_not_even_an_engine_port_on_the_hosts_loopback(backend, parent_dir, listener):
    port, accepted = listener
    probe = ("python3 -c \"import socket\nfor addr in [('127.0.0.1', %d), ('1.1.1.1', 53)]:\n    try:\n"
             "        socket.create_connection(addr, timeout=1); print('CONNECTED', addr)\n"
             "    except OSError as e:\n        print('refused', e.errno)\"") % port
    out = confine(backend, parent_dir, probe)
    assert "CONNECTED" not in out["steps"][0]["stdout"] and out["steps"][0]["stdout"].count("refused") == 2
    assert accepted == []


def test_disk_fill_stops_at_the_quota(backend, parent_dir):
    out = confine(backend, parent_dir,
                  "for i in 1 2 3 4; do head -c 700000 /dev/zero > f$i || echo FULL $i; done",
                  "head -c 100000000 /dev/zero > /tmp/big || echo TMP FULL; head -c 100000000 /dev/zero > /dev/shm/big "
                  "|| echo SHM FULL", disk_mb=2, max_file_mb=200)
    work, tmp = out["steps"]
    assert "FULL" in work["stdout"] and "No space left on device" in work["stderr"]
    assert work["workdir_bytes"] <= 2 << 20
    assert "TMP FULL" in tmp["stdout"] and "SHM FULL" in tmp["stdout"]


def test_eight_processes_together_cannot_exceed_the_sandbox_memory(backend, parent_dir):
    # 8 processes of 48 MiB each under a 192 MiB sandbox: each is far below the per-process address
    # space limit (also 192 MiB), so only a limit on the sandbox as a whole can stop them.
    hog = ("python3 -c 'import time; x = bytearray(b\"x\") * (48 << 20); print(\"alive\", flush=True); "
           "time.sleep(4); print(\"done\", flush=True)'")
    out = confine(backend, parent_dir, " & ".join([hog] * 8) + " & wait", memory_mb=192, wall_timeout_s=30,
                  cpu_time_s=10, timeout_s=90)
    step, group = out["steps"][0], out["cgroup"]
    assert step["stdout"].count("done") < 8, step
    assert any("memory limit exceeded (192 MiB for the whole sandbox)" in v for v in step["violations"]), step
    assert group["oom_kills"] >= 1 and group["peak_bytes"] is not None and group["peak_bytes"] <= 192 << 20, group


def test_thousands_of_small_files_stop_at_the_disk_quota(backend, parent_dir):
    # The way one sandbox filled 40 MB of the host's /tmp: many files, each far below max_file_mb.
    # The working directory is a tmpfs of disk_mb, so they stop at its size (a page each) or its inodes.
    fill = ("python3 -c \"import os\nn = 0\ntry:\n    for n in range(20000):\n"
            "        open(f'f{n}', 'wb').write(os.urandom(3000))\n"
            "except OSError as e:\n    print(n, e.errno)\" ; du -sk . | cut -f1")
    out = confine(backend, parent_dir, fill, disk_mb=16, max_file_mb=1)
    step = out["steps"][0]
    written, err, used_kib = map(int, step["stdout"].split())
    assert err == errno.ENOSPC, step
    assert 3000 < written < 4200  # thousands got in, then the quota (16 MiB: 4096 pages, 4096 inodes)
    assert used_kib <= 16 << 10 and step["workdir_bytes"] <= 16 << 20, step


def test_the_checkout_the_package_root_and_the_hosts_tmp_are_not_readable(backend, parent_dir):
    host_tmp = Path(tempfile.gettempdir()) / f"miles-host-secret-{os.getpid()}"
    host_tmp.write_text("host secret\n")
    host_tmp.chmod(0o644)
    try:
        targets = [REPO / "README.md", Path(miles.__file__), Path(miles.__file__).parent, Path("/work/main"),
                   Path("/root"), Path("/root/.bashrc"), Path("/etc/passwd"), host_tmp,
                   Path("/var/tmp") / host_tmp.name]
        probe = ("python3 -c \"import json, os, sys\nout = {}\nfor p in sys.argv[1:]:\n    try:\n"
                 "        out[p] = 'READ ' + (str(os.listdir(p)) if os.path.isdir(p) else open(p).read(40))\n"
                 "    except OSError as e:\n        out[p] = e.errno\nprint(json.dumps(out))\" "
                 + " ".join(str(t) for t in targets))
        out = confine(backend, parent_dir, probe)
    finally:
        host_tmp.unlink()
    seen = json.loads(out["steps"][0]["stdout"])
    assert seen == {str(t): errno.ENOENT for t in targets}  # none of them exists inside at all


def test_without_a_cgroup_it_may_write_the_rootless_sandbox_refuses_and_says_what_the_host_needs(parent_dir):
    # The same child as above, minus the delegated cgroup: uid 65534 may make no group on this host.
    out = child_report("rootless", parent_dir, "echo ran", delegate=False)
    if "unavailable" not in out:
        pytest.skip(f"uid {out['euid']} may make cgroups on this host, so there is no refusal to see")
    why = out["unavailable"]
    if "cgroup" not in why:
        pytest.skip(f"the rootless sandbox cannot run here for another reason: {why}")
    assert "limits memory_mb and max_processes for all of a sandbox's processes together" in why, why
    assert "run as root" in why and "chown to this user the cgroup v1 memory" in why and "cgroup v2" in why, why
    assert list(parent_dir.iterdir()) == []  # nothing was started


def test_without_a_writable_cgroup_the_root_sandbox_refuses_and_says_what_the_host_needs(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the root backend needs root before it looks for a cgroup")
    # A host whose cgroup filesystem offers nothing (an empty folder stands in for /sys/fs/cgroup).
    monkeypatch.setattr(cgroup_mod, "ROOT", tmp_path)
    monkeypatch.setattr(sandbox_mod, "_probe_results", {})
    with pytest.raises(SandboxUnavailable, match="needs a cgroup to limit the memory of all its processes together"
                                                 ".*the host needs: run as root .*; or chown to this user"):
        Sandbox(SandboxConfig(backend="root"))


def test_huge_output_is_truncated_and_a_flood_is_stopped(backend, parent_dir):
    t0 = time.monotonic()
    out = confine(backend, parent_dir, "head -c 10000 /dev/zero | tr '\\0' a", "yes")
    some, flood = out["steps"]
    assert len(some["stdout"]) == 4096 and "output truncated to 4096 bytes per stream" in some["violations"]
    assert any("output flood" in v for v in flood["violations"]) and not flood["timed_out"]
    assert len(flood["stdout"]) == 4096 and flood["processes"] == []
    assert time.monotonic() - t0 < 15


_OWNER = r"""
import json, os, sys, threading, time
from pathlib import Path
from miles.rollout.environments.sandbox import Sandbox, SandboxConfig
for procs in json.loads(sys.argv[2]):
    Path(procs).write_text(str(os.getpid()))
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
sb = Sandbox(SandboxConfig(backend="rootless"), parent_dir=sys.argv[1])
sb.write_file("x.txt", "x")
threading.Thread(target=sb.run, args=("sleep 876543",), daemon=True).start()
time.sleep(1.0)
print(json.dumps({"workdir": str(sb.workdir), "running": sb.processes()}), flush=True)
time.sleep(1000)
"""


def test_a_killed_owner_of_a_rootless_sandbox_leaves_no_process_and_no_directory(parent_dir):
    try:
        check_available("rootless")
    except SandboxUnavailable as e:
        pytest.skip(f"no rootless sandbox here: {e}")
    with delegated_cgroups(NOBODY) as join:
        owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(parent_dir), json.dumps(join)],
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            line = owner.stdout.readline()
            if not line:
                pytest.skip("the rootless sandbox cannot run here as uid 65534 (no cgroup it may write)")
            info = json.loads(line)
            assert info["running"] and Path(info["workdir"], "x.txt").exists()
        finally:
            owner.kill()
            owner.wait()
    # The command dies with its owner's thread (parent-death signal), the holder with its owner
    # (and the working directory's tmpfs with the holder); only an empty mount point stays on the host.
    deadline = time.monotonic() + 5
    while (host_processes_with_cmdline("sleep", "876543") or Path(info["workdir"]).exists()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes_with_cmdline("sleep", "876543") == []
    assert not Path(info["workdir"]).exists()
    assert [p.name for p in parent_dir.iterdir()] and all(not any(p.iterdir()) for p in parent_dir.iterdir())
    with Sandbox(SandboxConfig(backend="rootless"), parent_dir=str(parent_dir)):
        assert len(list(parent_dir.iterdir())) == 1  # the next sandbox swept the dead owner's; its own is there
    assert list(parent_dir.iterdir()) == []


def test_the_rootless_backend_started_as_root_runs_commands_as_a_throwaway_uid(parent_dir):
    if os.geteuid() != 0:
        pytest.skip("this case is about starting the rootless backend as root")
    try:
        check_available("rootless")
    except SandboxUnavailable as e:
        pytest.skip(f"no rootless sandbox here: {e}")
    with Sandbox(SandboxConfig(backend="rootless"), parent_dir=str(parent_dir)) as sb:
        assert sb.backend == "rootless" and sb.uid >= 200_000
        sb.write_file("task/in.txt", "from the host\n")
        r = sb.run("cat task/in.txt > task/out.txt && echo more >> task/out.txt && (sleep 3 &) && "
                   "cat /proc/self/status | grep -E '^(Uid|CapEff)'")
        assert r.ok, r.stderr
        assert sb.read_file("task/out.txt") == "from the host\nmore\n"
        assert "CapEff:\t0000000000000000" in r.stdout
        assert sb.processes() == []
        assert sb.run("ln -s /etc task/link").ok
        with pytest.raises(SandboxError, match="passes through a symlink"):
            sb.write_file("task/link/evil", "x")
    assert not Path("/etc/evil").exists()


def test_the_backend_is_chosen_by_config_and_a_missing_piece_is_named(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="sandbox.backend = 'docker': write one of 'auto', 'root', 'rootless'"):
        SandboxConfig(backend="docker").validate()
    with pytest.raises(ConfigError, match="sandbox.extra_ro_paths: 'opt/tool' is not an absolute path"):
        SandboxConfig(extra_ro_paths=["opt/tool"]).validate()
    # No bwrap: the rootless backend says so, and how to install it.
    monkeypatch.setattr(sandbox_mod, "_probe_results", {})
    monkeypatch.setattr(rootless_mod.shutil, "which", lambda name, path=None: None if name == "bwrap" else "/x")
    with pytest.raises(SandboxUnavailable, match=r"`bwrap` is not installed \(run scripts/install-system.sh"):
        Sandbox(SandboxConfig(backend="rootless"))
    # User namespaces switched off by the kernel: the setting that does it is named.
    monkeypatch.undo()
    knob = tmp_path / "max_user_namespaces"
    knob.write_text("0\n")
    monkeypatch.setattr(sandbox_mod, "_probe_results", {})
    monkeypatch.setattr(rootless_mod, "USERNS_KNOBS", ((str(knob), "0"),))
    with pytest.raises(SandboxUnavailable, match=f"user namespaces are disabled on this machine \\({knob} = 0\\)"):
        check_available("rootless")
    # auto: root when root and the root backend works, rootless otherwise; nothing works -> both reasons.
    monkeypatch.setattr(sandbox_mod, "_probe_results", {"root": "no cgroup", "rootless": "no bwrap"})
    with pytest.raises(SandboxUnavailable, match="no sandbox backend works here; .*rootless: no bwrap"):
        check_available("auto")
    monkeypatch.setattr(sandbox_mod, "_probe_results", {"root": "", "rootless": ""})
    monkeypatch.setattr(sandbox_mod.os, "geteuid", lambda: 1000)
    assert check_available("auto") == "rootless"
    monkeypatch.setattr(sandbox_mod.os, "geteuid", lambda: 0)
    assert check_available("auto") == "root"
    monkeypatch.setattr(sandbox_mod, "_probe_results", {"root": "no cgroup", "rootless": ""})
    assert check_available("auto") == "rootless"
