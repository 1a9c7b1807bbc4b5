"""A sandbox's cgroup on its own: one process limit and one memory limit for all its members together."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from miles.rollout.environments.cgroup import PIDS_SLACK, CgroupUnavailable, SandboxCgroup

_FORK_UNTIL_REFUSED = """
import os, signal, time
children = []
try:
    for _ in range(100):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        children.append(pid)
    print(len(children), 0)
except OSError as e:
    print(len(children), e.errno)
for pid in children:
    os.kill(pid, signal.SIGKILL)
"""


@pytest.fixture
def group():
    try:
        g = SandboxCgroup.create(os.getpid(), "test", 256 << 20, max_processes=4)
    except CgroupUnavailable as e:
        pytest.skip(f"no cgroup for a sandbox here: {e}")
    yield g
    g.remove()


def test_the_process_limit_counts_every_member_whoever_runs_it(group):
    if group.pids_path is None:
        pytest.skip(f"this host's {group.kind} has no pids controller")
    # Run as this (possibly root) user, whom RLIMIT_NPROC would not stop: only the group does.
    r = subprocess.run([sys.executable, "-c", _FORK_UNTIL_REFUSED], capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: group.join(os.getpid()))
    children, err = map(int, r.stdout.split())
    assert err == errno.EAGAIN and children == 4 + PIDS_SLACK - 1, r  # the parent is a member too
    assert group.refused_forks() >= 1


def test_remove_kills_what_is_left_and_deletes_the_groups(group):
    proc = subprocess.Popen(["sleep", "1000"], preexec_fn=lambda: group.join(os.getpid()))
    assert str(proc.pid) in (group.path / "cgroup.procs").read_text().split()
    group.remove()
    assert proc.wait(timeout=10) == -9
    assert not any(d.exists() for d in group.dirs)
