"""Admin calls to every engine of the run: pause and continue around a weight push, release and
resume memory (colocated turn-taking), abort requests; and waiting for the router to have an engine.

The serving set changes at run time (the fleet replaces engines), so calls follow `set_urls`.
Non-goals: generation (group.py) and weight transfer (sync/).
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import httpx

from miles.net import bearer_headers


class EngineAdmin:
    def __init__(self, engine_urls: list[str], admin_token: str | None = None, router_url: str | None = None):
        self.urls = list(engine_urls)
        self.headers = bearer_headers(admin_token)
        # Generation goes through the router when there is one: it spreads load and retries a request
        # whose engine died before answering on a live engine.
        self.router_url = router_url

    def set_urls(self, urls: list[str]) -> None:
        """The serving engines changed (one replaced, added or removed); admin calls follow them."""
        self.urls = list(urls)

    def memory(self, action: Literal["release", "resume"], tags: list[str] | None = None) -> bool:
        """Ask every engine to release (or take back) its memory, the kinds in `tags` (None: all); False
        when they do not offer it."""
        ok = True
        body = {} if tags is None else {"tags": list(tags)}
        for url in self.urls:
            r = httpx.post(f"{url}/{action}_memory_occupation", json=body, headers=self.headers, timeout=120)
            if r.status_code == 404:
                ok = False
            elif r.status_code != 200:
                raise RuntimeError(f"{url}/{action}_memory_occupation answered {r.status_code}: {r.text[:200]}")
        return ok

    def call(self, endpoint: str, body: dict) -> None:
        """POST `body` to `endpoint` of every engine (pause_generation, continue_generation, ...)."""
        for url in list(self.urls):
            try:
                r = httpx.post(f"{url}/{endpoint}", json=body, headers=self.headers, timeout=120)
            except httpx.TransportError:
                if self.router_url is None:
                    raise
                continue  # a dead engine: the health monitor replaces it, and its replacement starts unpaused
            if r.status_code != 200:
                raise RuntimeError(f"{url}/{endpoint} answered {r.status_code}: {r.text[:200]}")

    async def abort_all(self, client) -> None:
        for url in self.urls:
            try:
                await client.post(f"{url}/abort_request", json={"abort_all": True}, timeout=2, headers=self.headers)
            except Exception:  # noqa: BLE001 - an unreachable engine has nothing in flight to abort
                pass

    @staticmethod
    async def abort_rids(client, url: str, rids: list[str]) -> None:
        async def one(rid):
            try:
                await client.post(f"{url}/abort_request", json={"rid": rid}, timeout=2)
            except Exception:  # noqa: BLE001 - best effort: the engine may be the thing that failed
                pass

        # Short and concurrent: a hung engine must not hold the group's slot much past its timeout.
        await asyncio.gather(*(one(r) for r in rids))

    async def wait_for_router(self, client, timeout_s: float, stopping) -> None:
        """Hold a failed group while the router has no engine to serve it (all being replaced), so its
        retry is not spent at once on the same failure."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stopping.is_set():
            try:
                if (await client.get(f"{self.router_url}/health", timeout=5)).status_code == 200:
                    return
            except Exception:  # noqa: BLE001 - the router itself unreachable: keep waiting until the deadline
                pass
            await asyncio.sleep(0.5)
