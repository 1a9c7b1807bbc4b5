"""Token streaming: one request's output tokens on an event loop, as the scheduler samples them.

`stream(engine, req)` is an async iterator of `TokenDelta`s (the tokens of one step, with their
logprobs) ending with the request's `GenerateResult`. The deltas come before the result, their ids
concatenated are exactly the result's output_ids (the engine only appends tokens; stop strings trim
the text, never the ids). Leaving the iterator early aborts the request, freeing its batch slot.
Used by /generate with `stream: true` (server.py) and by /v1/chat/completions with `stream: true`
(openai_routes.py).

Non-goals: the wire format (the callers'), batched streams, top-logprobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from miles.engine_api.types import GenerateRequest, GenerateResult


@dataclass(frozen=True)
class TokenDelta:
    ids: list[int]
    logprobs: list[float]


async def stream(engine, req: GenerateRequest) -> AsyncIterator[TokenDelta | GenerateResult]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def listener(ids: list[int], logprobs: list[float]) -> None:  # on the scheduler's thread
        loop.call_soon_threadsafe(queue.put_nowait, TokenDelta(ids, logprobs))

    done = asyncio.wrap_future(engine.submit(req, listener))
    # Scheduled after every delta the listener queued: the scheduler hands over the tokens first.
    done.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (delta := await queue.get()) is not None:
            yield delta
        yield done.result()
    finally:
        if not done.done():  # the consumer went away: free the slot
            engine.abort(req.rid)
