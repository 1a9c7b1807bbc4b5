"""The fully-async producer: a background thread that keeps groups in flight and puts each into the
buffer as it finishes, until stopped.

    buffer.admit() ──► prompt ──► GroupGenerator.generate_group ──► buffer.put(group)
         ▲ blocks while buffer.max_inflight_groups are in flight or the buffer is full (backpressure)

Who waits on whom: the producer waits on the buffer's admission (capacity, staleness); the trainer
waits on `buffer.get`. Stopping closes the buffer, aborts what is in flight at the engines (those
groups come back aborted and go to the retry queue) and waits for the thread.
Non-goals: generating one group (group.py); the sync and one-step-off schedules (manager.generate_batch).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from miles.buffer.data_buffer import BufferClosed
from miles.rollout.group import GroupGenerator


class Producer:
    def __init__(self, groups: GroupGenerator):
        self.groups = groups
        self.buffer, self.admin, self.stopping = groups.buffer, groups.admin, groups.stopping
        self.error: BaseException | None = None  # surfaced to the trainer by the manager's collect()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        self.stopping.clear()
        self.buffer.reopen()
        self.groups.take_stats(None)  # the producer's figures start now
        self._thread = threading.Thread(target=self._main, name="rollout-producer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        if self._thread is None:
            return
        self.stopping.set()
        self.buffer.close()
        self._thread.join(timeout)
        self._thread = None
        self.buffer.reopen()

    def _main(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer by collect()
            self.error = e
            self.buffer.close()

    async def _produce(self) -> None:
        # Producers blocked by backpressure each hold a thread; admission needs one more.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(self.buffer.cfg.max_inflight_groups + 4, thread_name_prefix="buffer"))
        tasks: set[asyncio.Task] = set()
        async with self.admin.async_http(self.groups.cfg.request_timeout_s) as client:
            while not self.stopping.is_set():
                try:
                    prompt = await asyncio.to_thread(self.buffer.admit, 0.2)
                except BufferClosed:
                    break
                if prompt is None:
                    continue
                task = asyncio.create_task(self._produce_one(client, prompt))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                # In-flight requests come back aborted; their groups go to the retry queue.
                await self.admin.abort_all(client)
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _produce_one(self, client, prompt) -> None:
        group = await self.groups.generate_group(client, prompt)
        await asyncio.to_thread(self.buffer.put, group)
