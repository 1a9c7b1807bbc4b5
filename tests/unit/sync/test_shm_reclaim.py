"""Shared-memory weight buffers of killed processes are reclaimed; those of live ones never are.

A real engine lends a p2p receive buffer in /dev/shm, is SIGKILLed (it cannot unlink anything), and
the fleet's kill leaves /dev/shm clean; a buffer of any owner killed the same way is unlinked by the
next `shm.create` on the host.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx

from miles.sync import shm

REPO = Path(__file__).resolve().parents[3]
TOKEN = "shm-test-token"

_OWNER = """
import sys, time
from miles.sync import shm
path, buf = shm.create(1 << 20, tag="p2p", touch=True)
print(path, flush=True)
time.sleep(1000)
"""


def _owner() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, proc.stdout.readline().strip()


def test_the_fleet_leaves_dev_shm_clean_after_sigkilling_an_engine(tiny_model_dir):
    from miles.orchestration.fleet import EngineHandle
    from miles.engine.process import EngineProcess

    proc = EngineProcess(tiny_model_dir, admin_token=TOKEN, extra_args=["--num-threads", "1"])
    engine = EngineHandle(proc.url, proc.proc.pid, proc.stop)
    try:
        r = httpx.post(proc.url + "/p2p_open_buffer", json={"nbytes": 4 << 20},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        path = r.json()["shm_path"]
        assert Path(path).exists() and f"-{proc.proc.pid}-" in path
    finally:
        engine.kill()  # SIGKILL: the engine runs no cleanup of its own
    assert proc.proc.returncode == -signal.SIGKILL
    assert not Path(path).exists()
    assert not [n for n in os.listdir(shm.SHM_DIR) if f"-{proc.proc.pid}-" in n]


def test_the_next_create_reclaims_buffers_of_killed_owners_and_spares_live_ones():
    dead, dead_path = _owner()
    live, live_path = _owner()
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        assert Path(dead_path).exists()  # leaked: nobody unlinked it
        mine, _ = shm.create(1 << 16)
        try:
            assert not Path(dead_path).exists()
            assert Path(live_path).exists()  # its owner still runs and holds the lock
            assert Path(mine).exists() and stat.S_IMODE(os.stat(mine).st_mode) == 0o600
        finally:
            shm.unlink(mine)
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
    assert live_path in shm.reclaim_stale()


def test_a_buffer_whose_owner_takes_no_lock_is_spared_while_that_owner_lives():
    # A writer without the lock (an older miles) must not lose its buffer to a newer one on the host.
    path = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}p2p-{os.getpid()}-unlocked{time.monotonic_ns()}")
    Path(path).write_bytes(b"\0" * 64)
    try:
        assert path not in shm.reclaim_stale()
        assert Path(path).exists()
    finally:
        os.unlink(path)
