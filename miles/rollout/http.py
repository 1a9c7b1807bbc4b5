"""The rollout side's HTTP plumbing: one client configuration for talking to engines and routers, and
running a batch of requests from the synchronous methods a threaded Ray actor exposes.

Non-goals: what is requested (group.py, evaluator.py, engine_admin.py).
"""

from __future__ import annotations

import asyncio
import threading

import httpx


def async_client(timeout_s: float):
    """An httpx.AsyncClient sized for a whole step's requests in flight at once."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=timeout_s, limits=limits)


def run_coroutine(coro):
    """asyncio.run on a fresh thread: a threaded Ray actor may call us from a thread whose event loop
    is already running, where asyncio.run refuses to start."""
    out: dict = {}

    def main():
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=main, name="rollout-io")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def run_jobs(jobs, timeout_s: float) -> list:
    """Run `job(client)` for every job concurrently on one client; results in order."""

    async def run():
        async with async_client(timeout_s) as client:
            return await asyncio.gather(*(job(client) for job in jobs))

    return run_coroutine(run())
