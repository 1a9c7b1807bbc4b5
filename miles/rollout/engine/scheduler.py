"""The scheduler: the engine's request queue and the one background thread that drives the model runner.

Each iteration of the loop it
  1. admits waiting requests, up to max_batch_size running, and has the runner prefill them;
  2. applies aborts (after admission, so an abort that raced with it still finds its row);
  3. has the runner decode one token for every running row;
  4. answers rows that finished (EOS, stop token or string, max_new_tokens, context length, abort) at
     once, so a finished request frees its slot for the next step.
Whatever holds `_cond` may read the queue; only the loop's thread touches the running batch.

Pausing (SGLang's pause modes): `abort` finishes everything in flight as aborted; `retract` puts
running requests back at the head of the queue (their KV goes to the prefix cache, so resuming
re-prefills little) and they continue after /continue_generation; `in_place` stops stepping and keeps
the running batch and its KV as they are. Memory release (memory.py) holds generation the same way
until the memory is resumed. New requests queue meanwhile.

Non-goals: priorities, preemption by length or memory pressure, chunked prefill; the torch work
itself (model_runner.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from miles.rollout.engine.config import EngineConfig
from miles.rollout.engine.model_runner import ModelRunner, Row
from miles.rollout.engine.types import PAUSE_MODES, FinishReason, GenerateRequest, InvalidRequest

log = logging.getLogger(__name__)


class Scheduler:
    """Starts its thread at once; `stop` ends it, answering whatever is left as aborted."""

    def __init__(self, config: EngineConfig, runner: ModelRunner):
        self.config = config
        self.runner = runner
        self._cond = threading.Condition()
        self._waiting: deque[Row] = deque()
        self._aborts: set[str] = set()  # rids to abort at the next step; only ever rids in flight
        self._inflight: set[str] = set()  # rids admitted to the running batch and not yet finished
        self._stopping = False
        self._paused = False  # set by /pause_generation, cleared by /continue_generation
        self._unservable: str | None = None  # why the weights may not be served (a verification's noise)
        self._released: set[str] = set()  # memory tags released (memory.py); generation waits while non-empty
        self._control: list[tuple[str, threading.Event]] = []  # quiesce requests for the loop
        self._thread = threading.Thread(target=self._loop, name="miles-engine-scheduler", daemon=True)
        self._thread.start()

    def submit(self, req: GenerateRequest) -> Future:
        """Queue a request; the future resolves to a GenerateResult."""
        fut: Future = Future()
        row = Row.of(req, fut)
        if req.params.max_new_tokens == 0:
            fut.set_result(self.runner.result(row, FinishReason("length", length=0)))
            return fut
        with self._cond:
            if self._stopping:
                fut.set_result(self.runner.result(row, FinishReason("abort", message="engine stopped")))
                return fut
            self._waiting.append(row)
            self._cond.notify()
        return fut

    def abort(self, rid: str | None = None) -> None:
        """Abort one request by id, or every request when rid is None; they finish with type abort and
        keep whatever they generated so far."""
        with self._cond:
            keep = deque()
            for row in self._waiting:
                if rid is None or row.req.rid == rid:
                    row.future.set_result(self.runner.result(row, FinishReason("abort", message="aborted")))
                else:
                    keep.append(row)
            self._waiting = keep
            # Only rids in flight now: a stale entry would abort a later request that reuses the id.
            self._aborts |= set(self._inflight) if rid is None else {rid} & self._inflight
            self._cond.notify()

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cond:
            return self.runner.num_running, len(self._waiting)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def released(self) -> tuple[str, ...]:
        return tuple(sorted(self._released))

    def pause(self, mode: str = "abort", timeout: float = 120.0) -> None:
        """Stop generating; returns once no forward is running and `mode` has been carried out."""
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode: {mode!r} is not a pause mode; use one of {list(PAUSE_MODES)}")
        with self._cond:
            self._paused = True
            if mode == "abort":
                self.abort(None)
        self.quiesce(mode, timeout)

    def continue_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def hold(self, tags: tuple[str, ...]) -> None:
        """Generate nothing while any of these released memory tags is not resumed."""
        with self._cond:
            self._released.update(tags)

    def unhold(self, tags: tuple[str, ...]) -> None:
        with self._cond:
            self._released.difference_update(tags)
            self._cond.notify()

    @property
    def unservable(self) -> str | None:
        return self._unservable

    def set_unservable(self, reason: str | None) -> None:
        """Generate nothing while `reason` is set (the weights hold verification noise); None serves again."""
        with self._cond:
            self._unservable = reason
            self._cond.notify()

    def quiesce(self, mode: str, timeout: float) -> None:
        """Return once the loop is between steps, having retracted the running batch if mode is "retract"."""
        done = threading.Event()
        with self._cond:
            self._control.append((mode, done))
            self._cond.notify()
        if not done.wait(timeout):
            raise RuntimeError(f"the scheduler did not pause within {timeout}s")

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # ---- the loop ---------------------------------------------------------------------------

    def _held(self) -> bool:
        return self._paused or bool(self._released) or self._unservable is not None

    def _loop(self) -> None:
        # OpenMP thread counts are per calling thread: without this the scheduler thread would use
        # the default (every core) and fight the other processes on the machine.
        torch.set_num_threads(self.config.num_threads)
        runner = self.runner
        while True:
            with self._cond:
                while not (self._stopping or self._control or self._aborts
                           or (not self._held() and (self._waiting or runner.rows))):
                    self._cond.wait()
                if self._stopping:
                    break
                control, self._control = self._control, []
                aborts, self._aborts = self._aborts, set()
                admit = []
                if not self._held() and not control:
                    room = self.config.max_batch_size - runner.num_running
                    admit = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                    self._inflight.update(row.req.rid for row in admit)
            t0 = time.perf_counter()
            try:
                if admit:
                    self._evict_finished(compact=True)  # merging copies the batch anyway: drop finished rows now
                    runner.prefill(admit)
                    self._evict_finished()
                # After admission, so an abort that raced with it still finds its row.
                if aborts:
                    runner.abort(aborts)
                    self._evict_finished()
                if control:
                    if any(mode == "retract" for mode, _ in control):
                        self._retract_all()
                    for _, done in control:
                        done.set()
                    continue
                if runner.rows and not self._held():
                    runner.decode()
                    self._evict_finished()
                runner.stats["busy_s"] += time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
                log.exception("engine step failed; failing the running batch")
                for row in runner.rows + admit:
                    if not row.future.done():
                        row.future.set_exception(exc)
                runner.reset()
                with self._cond:
                    self._inflight.clear()
                for _, done in control:
                    done.set()
        self._shutdown()

    def _evict_finished(self, compact: bool = False) -> None:
        """Answer rows that finished and free their slots; the runner drops them from the batch tensors
        lazily (at once with `compact`)."""
        newly = self.runner.retire_finished()
        if newly:
            with self._cond:
                self._inflight.difference_update(row.req.rid for row in newly)
            for row in newly:
                if not row.future.done():
                    row.future.set_result(self.runner.result(row, row.finish))
        self.runner.compact(force=compact)

    def _retract_all(self) -> None:
        """Move every running row back to the head of the queue."""
        rows = self.runner.retract()
        if not rows:
            return
        with self._cond:
            self._inflight.difference_update(r.req.rid for r in rows)
            self._waiting.extendleft(reversed(rows))

    def _shutdown(self) -> None:
        with self._cond:
            pending = list(self._waiting)
            self._waiting.clear()
        for row in self.runner.rows:
            if not row.future.done():
                row.future.set_result(self.runner.result(row, FinishReason("abort", message="engine stopped")))
        for row in pending:
            row.future.set_result(self.runner.result(row, FinishReason("abort", message="engine stopped")))
        self.runner.reset()
