"""A run's router outlives its driver: started by a process whose whole process group is then SIGKILLed,
it keeps answering, its record (RUN_DIR/router.json) says where and who it is, and a later process
adopts it: the engines it lists are replaced by the new ones, it is restarted if it dies, and
stopped for good at the end. A router no driver adopts exits once it has had no engine for a while."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from miles.orchestration.router_supervisor import RECORD, RouterRecord, SupervisedRouter
from miles.rollout.liveness import HealthConfig
from miles.rollout.router import RouterConfig, RouterProcess

REPO = Path(__file__).resolve().parents[3]
DRIVER = """
import sys, time
from pathlib import Path
from miles.orchestration.router_supervisor import SupervisedRouter
from miles.rollout.liveness import HealthConfig
from miles.rollout.router import RouterConfig
r = SupervisedRouter(RouterConfig(admin_token="t0k"), ["http://127.0.0.1:9"], HealthConfig(interval_s=0.2),
                     state_dir=Path(sys.argv[1]))
print(r.pid, flush=True)
time.sleep(300)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _running(pid)


def test_a_router_outlives_its_killed_driver_and_the_next_driver_adopts_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=env, start_new_session=True)
    pids: list[int] = []
    try:
        pids.append(int(driver.stdout.readline()))
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its whole process group
        driver.wait()
        record = RouterRecord.load(tmp_path / RECORD)
        assert record is not None and record.pid == pids[0] and record.admin_token == "t0k"
        assert (tmp_path / RECORD).stat().st_mode & 0o777 == 0o600  # the admin token is in it
        time.sleep(1.0)
        assert _running(record.pid), "the router died with its driver"
        # It answers; with its only engine unreachable, that it has no engine to serve.
        assert httpx.get(record.url + "/health", timeout=5).status_code in (200, 503)

        health = HealthConfig(interval_s=0.2)
        new = ["http://127.0.0.1:10", "http://127.0.0.1:11"]
        assert SupervisedRouter.adopt(tmp_path, RouterConfig(admin_token="other"), new, health) is None
        router = SupervisedRouter.adopt(tmp_path, RouterConfig(admin_token="t0k"), new, health)
        assert router is not None and router.adopted and (router.url, router.pid) == (record.url, record.pid)
        try:
            assert sorted(httpx.get(router.url + "/list_workers", timeout=5).json()["urls"]) == new

            os.kill(record.pid, signal.SIGKILL)  # not the adopter's child: watched by its pid
            deadline = time.monotonic() + 60
            while router.pid == record.pid or not router.restarts or router.restarts[0]["serving_at"] is None:
                assert time.monotonic() < deadline, "the adopted router was not restarted within 60 s"
                time.sleep(0.2)
            pids.append(router.pid)
            assert httpx.get(router.url + "/list_workers", timeout=5).status_code == 200  # the same URL
            assert json.loads((tmp_path / RECORD).read_text())["pid"] == router.pid
            report = router.report()
            assert report["restarts"] == 1 and report["adopted"] and report["max_restart_s"] > 0
        finally:
            router.stop()
        assert _wait_gone(pids[-1], 5) and not (tmp_path / RECORD).exists()
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_nothing_is_adopted_without_a_live_router(tmp_path):
    config, health = RouterConfig(admin_token="t0k"), HealthConfig()
    assert SupervisedRouter.adopt(tmp_path, config, [], health) is None  # no record
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    RouterRecord("http://127.0.0.1:9", gone.pid, socket.gethostname(), "t0k", "", time.time()).save(tmp_path / RECORD)
    assert SupervisedRouter.adopt(tmp_path, config, [], health) is None  # its process is gone


def test_a_router_left_without_engines_exits_after_exit_without_engines_s():
    router = RouterProcess(["http://127.0.0.1:9"], extra_args=[
        "--router.exit_without_engines_s", "1", "--health.interval_s", "0.2", "--health.failure_threshold", "1"])
    try:
        router.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        router.stop()
        raise AssertionError("the router kept serving with no engine for 30 s")
    assert router.proc.returncode == 0
