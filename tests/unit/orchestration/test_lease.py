"""A detached engine's lease (orchestration/lease.py): renewed, it holds; left alone, it ends its holder
once, after lease_s; the renewer keeps every holder's lease, whatever one of them does. A real engine
actor whose lease nobody renews stops serving."""

from __future__ import annotations

import threading
import time

import httpx

from miles.orchestration.lease import Lease, LeaseRenewer


def test_a_lease_holds_while_renewed_and_ends_its_holder_once_after_lease_s():
    expired = []
    lease = Lease(0.5, lambda: expired.append(time.monotonic()), check_every_s=0.05)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:
        lease.renew()
        time.sleep(0.1)
    assert expired == []
    lease.renew()
    last = time.monotonic()
    time.sleep(1.5)
    assert len(expired) == 1 and 0.45 <= expired[0] - last <= 1.2  # the upper bound leaves a loaded machine room


def test_the_renewer_renews_every_holder_even_when_one_fails():
    renewed: dict[str, int] = {"a": 0, "b": 0}
    lock = threading.Lock()

    def renew(holder: str) -> None:
        if holder == "gone":
            raise RuntimeError("the actor died")
        with lock:
            renewed[holder] += 1

    renewer = LeaseRenewer(0.2, lambda: ["gone", "a", "b"], renew)  # every 0.05 s
    time.sleep(0.5)
    renewer.stop()
    assert renewed["a"] >= 3 and renewed["b"] >= 3


def test_an_engine_actor_whose_lease_nobody_renews_stops_serving(tiny_model_dir, ray_cluster):
    import ray

    from miles.orchestration.actors import EngineShell, remote
    from miles.engine.config import EngineConfig

    engine = remote(EngineShell).remote(EngineConfig(model_path=tiny_model_dir), None, 3.0)
    url = ray.get(engine.url.remote())
    try:
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/health", timeout=2)
            except httpx.HTTPError:
                break
            assert time.monotonic() < deadline, "the engine kept serving 30 s after its lease ran out"
            time.sleep(0.5)
    finally:
        ray.kill(engine)
