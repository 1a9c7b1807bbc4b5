"""Two real engine processes per module, and a built-in router in front of them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def engines(tiny_model_dir):
    from concurrent.futures import ThreadPoolExecutor

    from miles.engine.process import EngineProcess

    with ThreadPoolExecutor(2) as pool:  # start both at once: each spends seconds importing torch
        futures = [pool.submit(EngineProcess, tiny_model_dir) for _ in range(2)]
    procs = [f.result() for f in futures if f.exception() is None]
    if len(procs) < 2:
        for p in procs:
            p.stop()
        raise next(f.exception() for f in futures if f.exception() is not None)
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="package")
def router(engines):
    from miles.rollout.liveness import HealthConfig
    from miles.rollout.router import RouterConfig, start_router_thread

    r = start_router_thread(RouterConfig(), [e.url for e in engines], HealthConfig(interval_s=0.2, failure_threshold=2))
    yield r
    r.stop()
