"""Play an agent episode with a client that records every /generate exchange (request body, reply)."""

from __future__ import annotations

import asyncio
import json

import httpx


def play_recorded(episode, timeout: float = 120) -> tuple[object, list[tuple[dict, dict]]]:
    """Run `episode(client)` (an async function, e.g. one calling run_episode) to its end; return what
    it returned and the /generate exchanges it made, in order."""
    exchanges = []

    async def record(response):
        await response.aread()
        if response.request.url.path == "/generate":
            exchanges.append((json.loads(response.request.content), response.json()))

    async def main():
        async with httpx.AsyncClient(timeout=timeout, event_hooks={"response": [record]}) as client:
            return await episode(client)

    return asyncio.run(main()), exchanges
