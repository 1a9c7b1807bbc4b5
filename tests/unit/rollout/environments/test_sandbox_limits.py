"""What a sandbox contains per episode: unix sockets, disk, memory, the host's file calls, cleanup, leftovers.

Each test is an attempt a hostile command could make; before these limits each one got through.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from miles.rollout.environments.sandbox import (Sandbox, SandboxConfig, SandboxError, SandboxUnavailable,
                                                check_available, processes_of)
from miles.rollout.environments.workdir import remove_tree

try:
    check_available()
except SandboxUnavailable as e:
    pytestmark = pytest.mark.skip(reason=f"no sandbox on this machine: {e}")

REPO = Path(__file__).resolve().parents[4]


def within(seconds: float, fn, *args):
    """fn(*args) in a thread: its result or exception, failing the test if it is still blocked."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__} blocked for more than {seconds}s"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def listeners(tmp_path):
    """World-writable unix sockets where host services keep theirs, in world-traversable folders."""
    tag = f"miles-test-{os.getpid()}-{time.monotonic_ns()}"
    dirs = [Path("/run") / tag, Path("/var/lib") / tag, Path("/home") / tag, Path("/tmp") / tag]
    socks, paths = [], []
    for d in dirs:
        d.mkdir(parents=True)
        d.chmod(0o755)
        path = d / "service.sock"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.listen(4)
        s.setblocking(False)
        path.chmod(0o777)
        socks.append(s)
        paths.append(str(path))
    yield paths, socks
    for s in socks:
        s.close()
    for d in dirs:
        remove_tree(d)


def test_no_filesystem_unix_socket_of_the_host_is_reachable(listeners):
    paths, socks = listeners
    code = ("import json, socket, sys\n"
            "out = {}\n"
            "for p in sys.argv[1:]:\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n"
            "        s.connect(p); out[p] = 'CONNECTED'\n"
            "    except OSError as e:\n"
            "        out[p] = e.errno\n"
            "print(json.dumps(out))\n")
    with Sandbox() as sb:
        sb.write_file("probe.py", code)
        r = sb.run("python3 probe.py " + " ".join(paths) + "; ls /")
    lines = r.stdout.splitlines()
    assert json.loads(lines[0]) == {p: 2 for p in paths}  # ENOENT: the paths do not exist inside at all
    # The command's / is the minimal root: no /run, /home, /root, /sys, /work.
    assert set(lines[1:]) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt", "proc", "sbin", "tmp",
                              "usr", "var"}
    for s in socks:  # and no connection ever arrived
        with pytest.raises(BlockingIOError):
            s.accept()


def test_working_directory_has_a_disk_quota():
    with Sandbox(SandboxConfig(disk_mb=2, max_file_mb=16)) as sb:
        r = sb.run("for i in 1 2 3 4; do head -c 700000 /dev/zero > f$i || echo FULL $i; done; du -sk .")
        assert "No space left on device" in r.stderr and "FULL" in r.stdout
        used = sum(p.stat().st_size for p in sb.workdir.iterdir())
        assert used <= 2 << 20
        # Files, not only bytes: empty files stop at the inode cap (1024 for a 2 MiB quota).
        r = sb.run("python3 -c \"import os\nn = 0\ntry:\n    for n in range(5000):\n        open(f'e{n}', 'w').close()\n"
                   "except OSError as e:\n    print(n, e.strerror)\"")
        count, why = r.stdout.split(" ", 1)
        assert why.strip() == "No space left on device" and 900 < int(count) < 1100
        # The host's own writes meet the same quota, as a refusal.
        sb.run("rm -f f* e*")
        with pytest.raises(SandboxError, match="disk quota is full"):
            sb.write_file("big.bin", b"x" * (3 << 20))


def test_memory_limit_holds_for_all_processes_of_a_sandbox_together():
    # Six processes of 60 MiB each under a 200 MiB sandbox: per-process limits alone would let all live.
    cfg = SandboxConfig(memory_mb=200, wall_timeout_s=30)
    # Where the kernel may swap (cgroup v1 without a swap limit) all six can get to "alive" before the
    # sandbox's kill comes; none of them may live to the end.
    hog = ("python3 -c 'import time; x = bytearray(b\"x\") * (60 << 20); print(\"alive\", flush=True); "
           "time.sleep(3); print(\"done\", flush=True)'")
    with Sandbox(cfg) as sb:
        r = sb.run(" & ".join([hog] * 6) + " & wait")
        peak = sb.cgroup.peak_bytes()
        kind = sb.cgroup.kind
    assert r.stdout.count("done") < 6, r.stdout
    assert any("memory limit exceeded (200 MiB for the whole sandbox)" in v for v in r.violations), r.violations
    assert peak is None or peak <= 200 << 20, (kind, peak)


def test_host_file_calls_refuse_fifos_sockets_and_folders_without_blocking():
    with Sandbox() as sb:
        r = sb.run("mkfifo in out && mkdir folder && ln -s folder link && "
                   "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"sock\")'")
        assert r.ok, r.stderr
        with pytest.raises(SandboxError, match="'in' is a FIFO, not a regular file"):
            within(5, sb.read_file, "in")
        with pytest.raises(SandboxError, match="'out' is a FIFO, not a regular file"):
            within(5, sb.write_file, "out", "x")
        with pytest.raises(SandboxError, match="is a socket"):
            within(5, sb.read_file, "sock")
        with pytest.raises(SandboxError, match="is a directory"):
            within(5, sb.read_file, "folder")
        with pytest.raises(SandboxError, match="a symlink"):
            within(5, sb.write_file, "link", "x")
        # A FIFO the command holds open for reading: the host still refuses, and does not truncate or wait.
        sb.write_file("ok.txt", "fine")
        assert sb.read_file("ok.txt") == "fine"


def test_close_removes_a_1500_level_tree_and_never_raises():
    sb = Sandbox()
    r = sb.run("python3 -c \"import os\nfor _ in range(1500):\n    os.mkdir('d'); os.chdir('d')\nopen('f', 'w').write('x')\"")
    assert r.ok, r.stderr
    d = sb.workdir
    sb.close()
    assert not d.exists()
    sb.close()  # twice is fine


def test_remove_tree_deletes_any_depth_without_following_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    root = tmp_path / "tree"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(1500):  # deeper than any path may be long, and than Python's recursion limit
        os.mkdir("d", dir_fd=fd)
        os.symlink(str(outside), f"escape{i % 3}", dir_fd=fd) if i % 500 == 0 else None
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    remove_tree(root)
    assert not root.exists()
    assert (outside / "keep.txt").read_text() == "keep"


_OWNER = """
import json, sys, threading, time
from miles.rollout.environments.sandbox import Sandbox
sb = Sandbox()
sb.write_file("x.txt", "x")
threading.Thread(target=sb.run, args=("sleep 1000",), daemon=True).start()
time.sleep(1.0)
print(json.dumps({"workdir": str(sb.workdir), "cgroup": str(sb.cgroup.path), "uid": sb.uid}), flush=True)
time.sleep(1000)
"""


def test_a_killed_owner_leaves_no_process_and_its_leftovers_are_swept():
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        info = json.loads(owner.stdout.readline())
        assert processes_of(info["uid"])  # the command is running
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    # The command dies with its owner (PR_SET_PDEATHSIG takes its namespace down).
    deadline = time.monotonic() + 10
    while processes_of(info["uid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of(info["uid"]) == []
    assert Path(info["workdir"]).exists() and Path(info["cgroup"]).exists()  # close() never ran
    with Sandbox():  # the next sandbox sweeps what the dead owner left
        pass
    assert not Path(info["workdir"]).exists()
    assert not Path(info["cgroup"]).exists()
    assert info["workdir"] not in Path("/proc/self/mountinfo").read_text()
