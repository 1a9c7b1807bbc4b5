"""A run's router in a process of its own (router.own_process): SIGKILLed, it is started again on the
same port with the same settings, and requests through its URL are served again. A router whose
driver is SIGKILLed does not outlive it (nothing else would ever stop it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx


def _generate(url: str) -> httpx.Response:
    return httpx.post(url + "/generate", timeout=60, json={
        "input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 2}})


def test_the_router_process_is_started_with_the_runs_settings():
    from miles.orchestration.router_supervisor import router_args
    from miles.rollout.liveness import HealthConfig
    from miles.rollout.router import RouterConfig, parse_args

    router = RouterConfig(admin_token="t0k", max_retries=5, request_timeout_s=33.0, own_process=True)
    health = HealthConfig(interval_s=0.25, failure_threshold=4, enabled=False)
    served = parse_args(router_args(router, health, 41234) + ["--worker-urls", "http://127.0.0.1:1"])
    assert served.router.port == 41234 and served.router.admin_token == "t0k"
    assert (served.router.max_retries, served.router.request_timeout_s) == (5, 33.0)
    assert served.health == health and not served.router.own_process


def test_a_killed_router_is_restarted_on_its_port_and_serves_again(engines):
    from miles.orchestration.router_supervisor import SupervisedRouter
    from miles.rollout.liveness import HealthConfig
    from miles.rollout.router import RouterConfig

    urls = [e.url for e in engines]
    router = SupervisedRouter(RouterConfig(), urls, HealthConfig(interval_s=0.2), workers=lambda: urls)
    try:
        assert _generate(router.url).status_code == 200
        first = router.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                if router.pid != first and _generate(router.url).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the router did not serve again within 60 s"
            time.sleep(0.2)
        (rec,) = router.restarts
        assert rec["pid"] == first and rec["exit_code"] == -signal.SIGKILL and rec["serving_at"] is not None
        workers = httpx.get(router.url + "/list_workers").json()["workers"]
        assert sorted(w["url"] for w in workers if not w["quarantined"]) == sorted(urls)
        assert router.report()["restarts"] == 1
    finally:
        router.stop()
    try:  # stopped for good: nothing restarts it
        httpx.get(router.url + "/list_workers", timeout=2)
        raise AssertionError("the router still answers after stop()")
    except httpx.TransportError:
        pass


def test_a_router_process_ends_when_the_driver_that_started_it_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from miles.rollout.router import RouterProcess\n"
        "r = RouterProcess(['http://127.0.0.1:1'])\n"
        "print(r.proc.pid, flush=True)\n"
        "time.sleep(300)\n")], stdout=subprocess.PIPE, text=True)
    try:
        router_pid = int(parent.stdout.readline())
        assert os.kill(router_pid, 0) is None  # serving while its driver lives
        parent.kill()  # SIGKILL: the driver cannot stop its children
        parent.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            try:
                os.kill(router_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(router_pid, signal.SIGKILL)
            raise AssertionError("the router process outlived its killed driver by 30 s")
    finally:
        parent.kill()
        parent.wait()
