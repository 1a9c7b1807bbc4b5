"""Merging the batched /generate requests of groups that become ready together into one POST per engine.

A step's groups start in one `asyncio.gather`: each builds its samples' batched request and awaits it in
the same turn of the event loop. Sent one POST per group, 32 requests reach an engine over tens of
milliseconds, so its scheduler prefills twice and every process on the way (client, router, engine)
does the HTTP work 32 times. `RequestMerger` collects the requests registered in one turn, sends them
as one batched /generate per engine (the router's URL: split into as many POSTs as engines serve, so
its load balancing still spreads them) and hands each group its own slice of the reply.

Each group keeps its own semantics: its timeout cancels only its wait (the others' samples still
arrive), resumed samples of partial rollout merge with whatever else is ready in their turn, and a
request the server refuses (HTTP 4xx) is sent again alone with every other part of its POST, so only
the bad one fails, as it would have on its own. A failure of the POST itself (connection, 5xx) fails
every part of it: each group then goes through its own failure path.
Non-goals: merging requests with images (each is sent as it is) or across clients.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Callable

from miles.rollout.generate import GenerationError, generate_many


@dataclass
class _Part:
    prompts: list[list[int]]
    params: list
    rids: list[str]
    label: str | None
    prompt_index: int
    future: asyncio.Future = field(repr=False)


class RequestMerger:
    """`posts_for(url)`: how many POSTs a merged batch bound for `url` is split into (the number of
    engines behind a router, 1 for an engine's own URL)."""

    def __init__(self, posts_for: Callable[[str], int], return_routed_experts: bool = False):
        self.posts_for = posts_for
        self.routed = return_routed_experts
        self._pending: dict[tuple[int, str], list[_Part]] = {}
        self._posting: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self.posts = 0  # POSTs sent, for tests and figures

    async def generate(self, client, url: str, prompts: list[list[int]], params: list, rids: list[str],
                       label: str | None, prompt_index: int) -> list:
        """The Samples of `prompts`, in order, from a POST shared with the requests registered in the
        same turn of the event loop."""
        loop = asyncio.get_running_loop()
        part = _Part(prompts, params, rids, label, prompt_index, loop.create_future())
        key = (id(client), url)
        if key not in self._pending:
            self._pending[key] = []
            # Runs after every task already scheduled in this turn has had its step: a gather's groups
            # have all registered by then.
            loop.call_soon(self._flush, client, url, key)
        self._pending[key].append(part)
        return await part.future

    def _flush(self, client, url: str, key) -> None:
        parts = self._pending.pop(key)
        k = max(1, min(self.posts_for(url), len(parts)))
        for i in range(k):
            chunk = parts[i * len(parts) // k:(i + 1) * len(parts) // k]
            task = asyncio.ensure_future(self._post(client, url, chunk))
            self._posting.add(task)
            task.add_done_callback(self._posting.discard)

    async def _post(self, client, url: str, parts: list[_Part]) -> None:
        self.posts += 1
        try:
            samples = await generate_many(
                client, url, [p for part in parts for p in part.prompts],
                [sp for part in parts for sp in part.params], rids=[r for part in parts for r in part.rids],
                return_routed_experts=self.routed)
        except asyncio.CancelledError:  # the event loop is closing: nobody waits any more
            for part in parts:
                part.future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - handed to every waiting group, which decides
            if len(parts) > 1 and _refused(exc):  # find the part the server refuses: each alone
                await asyncio.gather(*(self._post(client, url, [part]) for part in parts))
            else:
                _fail(parts, exc)
            return
        at = 0
        for part in parts:
            mine = samples[at:at + len(part.prompts)]
            at += len(part.prompts)
            for s in mine:
                s.label, s.prompt_index = part.label, part.prompt_index
            if not part.future.done():  # a group that timed out no longer waits
                part.future.set_result(mine)


def _refused(exc: Exception) -> bool:
    """Whether the server answered 4xx: a request it refuses, not a failure of the server."""
    return isinstance(exc, GenerationError) and re.search(r" 4\d\d:", str(exc)) is not None


def _fail(parts: list[_Part], exc: Exception) -> None:
    for part in parts:
        if not part.future.done():
            part.future.set_exception(exc)
