"""Escape attempts against the terminal-task sandbox: each must be contained and reported."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

import miles.rollout.environments.sandbox as sandbox_mod
from miles.rollout.environments.sandbox import Sandbox, SandboxConfig, SandboxError, SandboxUnavailable, check_available, processes_of

try:
    check_available()
except SandboxUnavailable as e:  # the refusal itself is tested below
    pytestmark = pytest.mark.skip(reason=f"no sandbox on this machine: {e}")


@pytest.fixture
def sandbox(tmp_path):
    with Sandbox(SandboxConfig(wall_timeout_s=10, cpu_time_s=3, max_output_bytes=4096, max_processes=32,
                               max_file_mb=1, memory_mb=256)) as sb:
        yield sb


def test_commands_run_in_their_own_directory_and_keep_state(sandbox):
    r = sandbox.run("echo hello > greeting.txt && pwd && cat greeting.txt")
    assert r.ok and r.stdout.splitlines() == ["/var/tmp/work", "hello"]
    assert sandbox.read_file("greeting.txt") == "hello\n"
    assert sandbox.run("cat greeting.txt").stdout == "hello\n"  # state persists across commands
    assert sandbox.run("exit 3").exit_code == 3


def test_writes_outside_the_directory_do_not_land(sandbox, tmp_path):
    marker = f"miles-escape-{os.getpid()}"
    target = tmp_path / "outside.txt"
    r = sandbox.run(f"echo x > {target}; echo x > /tmp/{marker}; echo x > /etc/{marker}; "
                    f"echo x > /var/tmp/{marker}; echo x > /dev/shm/{marker}; "
                    f"echo x > ../{marker}; ls /tmp/{marker}")
    assert not target.exists()
    for d in ("/tmp", "/etc", "/var/tmp", "/dev/shm", str(sandbox.workdir.parent)):
        assert not Path(d, marker).exists(), f"the sandbox wrote into {d}"
    assert "Permission denied" in r.stderr or "No such file" in r.stderr


def test_host_side_file_access_refuses_paths_and_symlinks_that_leave(sandbox):
    with pytest.raises(SandboxError, match="relative path"):
        sandbox.write_file("../evil", "x")
    with pytest.raises(SandboxError, match="relative path"):
        sandbox.write_file("/etc/evil", "x")
    with pytest.raises(SandboxError, match="NUL byte"):
        sandbox.run("echo a\x00b")
    sandbox.run("ln -s /etc/hostname link")
    with pytest.raises(SandboxError, match="outside the sandbox"):
        sandbox.read_file("link")


def test_fork_bomb_is_contained_and_leaves_no_process(sandbox):
    t0 = time.monotonic()
    r = sandbox.run("b(){ b | b & }; b; sleep 30", timeout_s=3)
    # It ends at the timeout, or sooner when its first shell can no longer fork (the process limit).
    assert (r.timed_out and any("timeout" in v for v in r.violations)) or "fork" in r.stderr.lower(), r
    assert time.monotonic() - t0 < 10
    assert processes_of(sandbox.uid) == []
    assert sandbox.run("echo still usable").stdout == "still usable\n"


def test_sleeping_forever_is_killed_at_the_wall_clock_limit_with_its_children(sandbox):
    r = sandbox.run("sleep 1000 & sleep 1000", timeout_s=1)
    assert r.timed_out and not r.ok and r.elapsed_s < 5
    assert processes_of(sandbox.uid) == []


def test_cpu_time_limit():
    with Sandbox(SandboxConfig(cpu_time_s=1, wall_timeout_s=20)) as sb:
        r = sb.run("while :; do :; done")
    assert not r.ok and "cpu time limit exceeded" in r.violations
    assert not r.timed_out


def test_file_size_limit(sandbox):
    r = sandbox.run("head -c 5000000 /dev/zero > big")
    assert "file size limit exceeded" in r.violations
    assert os.path.getsize(sandbox.workdir / "big") <= 1 << 20


def test_memory_limit(sandbox):
    r = sandbox.run("python3 -c 'x = bytearray(600 * 1024 * 1024)'")
    assert r.exit_code != 0 and "MemoryError" in r.stderr


def test_huge_output_is_truncated_and_a_flood_is_stopped(sandbox):
    r = sandbox.run("head -c 10000 /dev/zero | tr '\\0' a")
    assert r.ok and r.truncated and len(r.stdout) == 4096
    assert "output truncated to 4096 bytes per stream" in r.violations
    t0 = time.monotonic()
    r = sandbox.run("yes")
    assert any("output flood" in v for v in r.violations) and not r.timed_out
    assert time.monotonic() - t0 < 5 and len(r.stdout) == 4096
    assert "[output truncated" in r.observation()


def test_no_network_not_even_the_hosts_loopback(sandbox):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                accepted.append(srv.accept())
                return
            except socket.timeout:
                pass

    t = threading.Thread(target=accept)
    t.start()
    code = ("import socket\n"
            "for addr in [('127.0.0.1', %d), ('1.1.1.1', 53)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=2); print('CONNECTED', addr)\n"
            "    except OSError as e:\n"
            "        print('refused', addr, e.errno)\n") % port
    sandbox.write_file("net.py", code)
    r = sandbox.run("python3 net.py")
    done.set()
    t.join()
    srv.close()
    assert "CONNECTED" not in r.stdout and r.stdout.count("refused") == 2
    assert accepted == []


def test_close_removes_the_directory(tmp_path):
    sb = Sandbox()
    sb.run("mkdir -p a/b && touch a/b/c")
    d = sb.workdir
    sb.close()
    assert not d.exists()
    with pytest.raises(SandboxError, match="closed"):
        sb.run("true")


def test_refuses_rather_than_running_unconfined(monkeypatch):
    monkeypatch.setattr(sandbox_mod, "_probe_results", {})
    monkeypatch.setattr(sandbox_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="needs root.*refusing to run terminal tasks unconfined"):
        Sandbox(SandboxConfig(backend="root"))


def test_a_command_killed_from_outside_ends_its_turn_and_the_sandbox_goes_on(sandbox):
    """A sandbox process SIGKILLed by something else (the OOM killer, an operator, a chaos run) ends that
    command at once with its signal in the exit status; the episode's next command runs in the same
    directory, its files intact."""
    import signal

    assert sandbox.run("echo kept > state.txt").ok
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(r=sandbox.run("sleep 30")))
    runner.start()
    deadline, killed = time.monotonic() + 10, 0
    while not killed and time.monotonic() < deadline:
        for pid in sandbox.processes():
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass  # a short-lived process of the command's setup, gone between listing and kill
        time.sleep(0.05)
    assert killed, "the command never started"
    runner.join(timeout=15)
    assert not runner.is_alive(), "the killed command did not end its turn"
    r = result["r"]
    assert not r.ok and not r.timed_out and r.elapsed_s < 15
    assert r.exit_code == 128 + signal.SIGKILL and "[exit status 137]" in r.observation()
    after = sandbox.run("cat state.txt")
    assert after.ok and after.stdout == "kept\n"
    assert sandbox.processes() == []
