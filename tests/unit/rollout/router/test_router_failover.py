"""A really killed engine process: requests fail over, it is quarantined, and re-admitted once back."""

from __future__ import annotations

import time
from urllib.parse import urlparse

import httpx


def _workers(url):
    return {w["url"]: w for w in httpx.get(url + "/list_workers").json()["workers"]}


def _wait(pred, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_killed_engine_is_quarantined_and_readmitted(tiny_model_dir, engines):
    from miles.engine.process import EngineProcess
    from miles.rollout.router import RouterProcess

    victim = EngineProcess(tiny_model_dir)
    port = urlparse(victim.url).port
    body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    with RouterProcess([engines[0].url, victim.url],
                       extra_args=["--health-check-interval-s", "0.2", "--failure-threshold", "2"]) as router:
        try:
            victim.proc.kill()  # SIGKILL: no goodbye, connections just fail
            victim.proc.wait()
            with httpx.Client(base_url=router.url, timeout=60) as c:
                codes = [c.post("/generate", json=body).status_code for _ in range(10)]
            assert codes == [200] * 10  # retried onto the live engine
            assert _wait(lambda: _workers(router.url)[victim.url]["quarantined"])
            assert "miles_router_retries_total" in httpx.get(router.url + "/metrics").text

            victim = EngineProcess(tiny_model_dir, port=port)  # back at the same address, same weights
            assert _wait(lambda: not _workers(router.url)[victim.url]["quarantined"])
            served = _workers(router.url)[victim.url]["served"]
            with httpx.Client(base_url=router.url, timeout=60) as c:
                for _ in range(4):
                    assert c.post("/generate", json=body).status_code == 200
            assert _workers(router.url)[victim.url]["served"] > served
        finally:
            victim.stop()
