"""The scheduler: the engine's request queue and the one background thread that drives the model runner.

Each iteration of the loop it
  1. admits waiting requests, up to max_batch_size running and within the KV budget (memory_fraction
     of the device, kv_cache.budget_tokens), and has the runner prefill them;
  2. applies aborts (after admission, so an abort that raced with it still finds its row);
  3. has the runner decode one token for every running row;
  4. answers rows that finished (EOS, stop token or string, max_new_tokens, context length, abort) at
     once, so a finished request frees its slot for the next step.
A streamed request (submit with a listener) is handed its new tokens after every prefill and decode
step, before it is answered.
Whatever holds `_cond` may read the queue; only the loop's thread touches the running batch.

Pausing (SGLang's pause modes): `abort` finishes everything in flight as aborted; `retract` puts
running requests back at the head of the queue (their KV goes to the prefix cache, so resuming
re-prefills little) and they continue after /continue_generation; `in_place` stops stepping and keeps
the running batch and its KV as they are. Memory release (memory.py) holds generation the same way
until the memory is resumed. New requests queue meanwhile.

Failure isolation: the checks at the edge (engine_api/parsing.py, Engine.make_request) refuse every
bad input they foresee; a step that raises anyway must not fail the requests that happened to share
it. Its batch is dropped (a forward that raised midway may have grown some layers' KV and not
others) and its unfinished requests become suspects: each runs one prefill and one decode step
alone, in an empty batch, before anything else is admitted. A suspect that raises alone is failed by itself
(RequestFailed, HTTP 422); the others keep the tokens they had (and those of their run alone) and go
back to the head of the queue, so they finish as they would have. A request whose step failed twice
while no run alone could be blamed (the fault is in the combination, or transient) is failed with
EngineStepFailed (HTTP 503, retry). A step that held a single row blames it at once.

Prefill budget: one iteration admits prompts up to max_prefill_tokens in all (at least one prompt; a
prompt identical to one admitted in the same iteration counts once, as the prefill computes it once), so a
burst of long prompts is prefilled over several iterations with a decode step of the running rows
between each. With the fast decode, a prompt longer than prefill_chunk_tokens is prefilled a chunk per
iteration (chunked_prefill.py), before the iteration's decode step.

Non-goals: priorities, preemption by length or memory pressure; the torch work
itself (model_runner.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from miles.devices import cpu_threads
from miles.engine_api.errors import EngineStepFailed, InvalidRequest, RequestFailed
from miles.engine_api.types import PAUSE_MODES, FinishReason, GenerateRequest
from miles.engine.config import EngineConfig
from miles.engine.model_runner import ModelRunner
from miles.engine.prefill import prompt_key
from miles.engine.row import Row

log = logging.getLogger(__name__)

# Failed steps a request may share, with no run alone blamed for them, before it is failed (503).
MAX_UNBLAMED_FAILURES = 2


@dataclass
class _Isolation:
    """One failed step being isolated: whether a run alone has found a culprit yet, and the suspects
    that ran alone without failing."""

    blamed: bool = False
    cleared: list[Row] = field(default_factory=list)


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
        self._isolation: _Isolation | None = None  # set while suspects of a failed step wait to run alone
        self._thread = threading.Thread(target=self._loop, name="miles-engine-scheduler", daemon=True)
        self._thread.start()

    def submit(self, req: GenerateRequest, listener=None) -> Future:
        """Queue a request; the future resolves to a GenerateResult. `listener(ids, logprobs)`, when
        given, is called on the scheduler's thread with each run of new output tokens as they are
        sampled, before the future resolves; it must be quick (hand the tokens to another thread)."""
        return self.submit_many([req], listener)[0]

    def submit_many(self, reqs: list[GenerateRequest], listener=None) -> list[Future]:
        """Queue requests in one go (a batched /generate): the loop finds all of them waiting or none,
        so one prefill can take the whole group. One future per request, as `submit`."""
        futures, rows = [], []
        for req in reqs:
            fut: Future = Future()
            futures.append(fut)
            row = Row.of(req, fut, listener)
            if req.params.max_new_tokens == 0 and row.input_logprob_start() is None:  # nothing to compute
                fut.set_result(self.runner.result(row, FinishReason("length", length=0)))
            else:
                rows.append(row)
        with self._cond:
            for row in rows:
                if self._stopping:
                    row.future.set_result(self.runner.result(row, FinishReason("abort", message="engine stopped")))
                else:
                    self._waiting.append(row)
            self._cond.notify()
        return futures

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
        torch.set_num_threads(cpu_threads(self.config.num_threads))
        runner = self.runner
        while True:
            with self._cond:
                while not (self._stopping or self._control or self._aborts
                           or (not self._held() and (self._waiting or runner.rows or runner.chunking))):
                    self._cond.wait()
                if self._stopping:
                    break
                control, self._control = self._control, []
                aborts, self._aborts = self._aborts, set()
                admit = []
                if not self._held() and not control:
                    admit = self._admit()
                    self._inflight.update(row.req.rid for row in admit)
            alone = len(admit) == 1 and admit[0].isolation == "suspect"
            t0 = time.perf_counter()
            try:
                if admit:
                    self._evict_finished(compact=True)  # merging copies the batch anyway: drop finished rows now
                    runner.prefill(admit)
                    self._stream(admit)
                    self._evict_finished()
                # After admission, so an abort that raced with it still finds its row.
                if aborts:
                    runner.abort(aborts)
                    self._evict_finished()
                if control:
                    runner.flush()  # the fast decode's last step recorded: a pause sees every token
                    self._stream(runner.rows)
                    self._evict_finished()
                    if any(mode == "retract" for mode, _ in control):
                        self._retract_all()
                    for _, done in control:
                        done.set()
                    continue
                if runner.chunking and not self._held():  # a chunk of a long prompt, then a decode step
                    runner.prefill_chunk()
                    self._stream(runner.rows)
                    self._evict_finished()
                if runner.rows and not self._held():
                    runner.decode()
                    self._stream(runner.rows)
                    self._evict_finished()
                if alone:
                    self._clear(admit[0])
                runner.stats["busy_s"] += time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine or its batch
                # Every row the step touched, once each (a failed prefill may or may not have merged `admit`).
                batch = list({id(r): r for r in runner.rows + runner.chunking + admit}.values())
                self._isolate(batch, exc, aborts)
                for _, done in control:
                    done.set()
        self._shutdown()

    def _stream(self, rows: list[Row]) -> None:
        """Hand each streamed row the tokens it has not seen yet; before its future resolves, so the
        listener has every token by the time the result arrives."""
        for row in rows:
            if row.listener is None or len(row.output_ids) == row.streamed:
                continue
            a, row.streamed = row.streamed, len(row.output_ids)
            try:
                row.listener(row.output_ids[a:], row.logprobs[a:])
            except Exception:  # noqa: BLE001 - a client that went away must not stop the engine
                log.warning("dropping the stream listener of %s", row.req.rid, exc_info=True)
                row.listener = None

    # ---- failure isolation ------------------------------------------------------------------

    def _admit(self) -> list[Row]:
        """Rows to merge into the batch this step (caller holds _cond): the next suspect alone, into an
        empty batch, while a failed step is being isolated; else waiting rows up to max_batch_size."""
        if self._waiting and self._waiting[0].isolation == "suspect":
            # Between two runs alone the batch is empty; otherwise let what runs finish first.
            return [self._waiting.popleft()] if not (self.runner.rows or self.runner.chunking) else []
        if self._isolation is not None:
            self._end_isolation()
        room = self.config.max_batch_size - self.runner.num_running
        admit: list[Row] = []
        if not self._waiting or room <= 0:
            return admit
        # Rows are padded to the longest, so the batch's KV is (rows x the longest reservation) tokens.
        longest = max((self._reserve(r) for r in self.runner.rows if r.finish is None), default=0)
        prefill_budget, prefill_tokens = self.config.max_prefill_tokens, 0
        admitted: set[tuple] = set()  # prefill.prompt_key of the rows admitted in this step
        while self._waiting and len(admit) < room:
            need = max(longest, self._reserve(self._waiting[0]))
            if (self.runner.num_running + len(admit) + 1) * need > self.runner.kv_budget and \
                    (self.runner.num_running or admit):
                break  # waits for room; an empty batch always takes one (its context fits, checked at start)
            # Prompts beyond this step's prefill budget wait for the next step: the running rows decode a
            # token between two prefills rather than waiting for a whole burst of long prompts. A prompt
            # identical to one admitted in this step costs nothing (the prefill computes it once).
            key = prompt_key(self.runner, self._waiting[0])
            prompt = 0 if key in admitted else len(key[0])
            if prefill_budget and admit and prefill_tokens + prompt > prefill_budget:
                break
            admitted.add(key)
            prefill_tokens += prompt
            longest = need
            admit.append(self._waiting.popleft())
        return admit

    def _reserve(self, row: Row) -> int:
        """Tokens of KV a row may come to hold: its prompt and what it may still generate, plus its
        recurrent state's weight in tokens (hybrid models, recurrent_state.py)."""
        total = len(row.req.input_ids) + row.req.params.max_new_tokens
        return min(total, self.runner.context_length) + self.runner.state_tokens

    def _isolate(self, batch: list[Row], exc: Exception, aborts: set[str]) -> None:
        """A step raised. Its KV is dropped; what had finished is answered; a row that ran alone is
        blamed; every other unfinished row is queued, first, as a suspect to run a step alone."""
        runner = self.runner
        runner.reset()
        runner.stats["failed_steps"] += 1
        open_rows = [r for r in batch if not r.future.done()]
        log.warning("engine step failed with %d request(s) in the batch (%s: %s); running each alone to find "
                    "the cause", len(batch), type(exc).__name__, exc, exc_info=exc)
        suspects = []
        with self._cond:
            self._inflight.difference_update(r.req.rid for r in open_rows)
            for row in open_rows:
                if row.finish is None and row.req.rid in aborts:  # aborted in the failed step: that still holds
                    row.finish = FinishReason("abort", message="aborted")
                if row.finish is not None:  # finished before the failure: its answer stands
                    self._answer(row)
                elif len(batch) == 1:
                    self._blame(row, exc)
                else:
                    row.isolation = "suspect"
                    suspects.append(row)
            if suspects:
                if self._isolation is None:
                    self._isolation = _Isolation()
                self._waiting.extendleft(reversed(suspects))
                self._cond.notify()

    def _clear(self, row: Row) -> None:
        """A suspect ran a step alone without failing: out of the batch it goes (its KV to the prefix
        cache), back into the queue behind the suspects still to run, unless that step finished it."""
        self.runner.stats["isolated_reqs"] += 1
        live = self.runner.retract(count=False)
        with self._cond:
            self._inflight.discard(row.req.rid)
            if not live:
                return
            if row.req.rid in self._aborts:  # its abort arrived during the run alone: no batch holds it now
                self._aborts.discard(row.req.rid)
                row.future.set_result(self.runner.result(row, FinishReason("abort", message="aborted")))
                return
            row.isolation = "cleared"
            if self._isolation is not None:
                self._isolation.cleared.append(row)
            at = next((i for i, r in enumerate(self._waiting) if r.isolation != "suspect"), len(self._waiting))
            self._waiting.insert(at, row)

    def _end_isolation(self) -> None:
        """Every suspect has run alone (caller holds _cond). With nobody blamed, the cleared rows carry
        the failure; at MAX_UNBLAMED_FAILURES they are failed (503) rather than retried again."""
        iso, self._isolation = self._isolation, None
        failed = set()
        for row in iso.cleared:
            row.isolation = None
            if iso.blamed or row.future.done():
                continue
            row.unblamed += 1
            if row.unblamed >= MAX_UNBLAMED_FAILURES:
                failed.add(id(row))
                self.runner.stats["failed_reqs"] += 1
                row.future.set_exception(EngineStepFailed(
                    f"engine error, retry: a batch step failed {row.unblamed} times with this request in it, "
                    "and no request of the batch failed when run alone"))
        if failed:
            self._waiting = deque(r for r in self._waiting if id(r) not in failed)

    def _blame(self, row: Row, exc: Exception) -> None:
        """`row` made a step raise when it ran alone: fail it, and it alone."""
        self.runner.stats["failed_reqs"] += 1
        if self._isolation is not None:
            self._isolation.blamed = True
        log.warning("request %s fails the engine step when run alone; refusing it", row.req.rid)
        row.future.set_exception(RequestFailed(
            f"the engine's step raised {type(exc).__name__}: {exc} on this request run alone; it was refused and "
            "the requests batched with it went on. Sent again as it is, it fails again: check its input_ids "
            "and sampling_params"))

    def _answer(self, row: Row) -> None:
        """Answer a finished row; a row whose result cannot be built (a decode that raises) is blamed."""
        try:
            result = self.runner.result(row, row.finish)
        except Exception as exc:  # noqa: BLE001 - it concerns this row only
            self._blame(row, exc)
        else:
            row.future.set_result(result)

    def _evict_finished(self, compact: bool = False) -> None:
        """Answer rows that finished and free their slots, then offer their KV to the prefix cache (the
        answers go out while it copies; the loop admits nothing in between, so a next turn sent at once
        still finds it cached); the runner drops them from the batch tensors lazily (at once with
        `compact`)."""
        newly = self.runner.retire_finished()
        if newly:
            with self._cond:
                self._inflight.difference_update(row.req.rid for row in newly)
            for row in newly:
                if not row.future.done():
                    row.future.set_result(self.runner.result(row, row.finish))
            self.runner.cache_retired(newly)
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
        for row in self.runner.rows + self.runner.chunking:
            if not row.future.done():
                row.future.set_result(self.runner.result(row, FinishReason("abort", message="engine stopped")))
        for row in pending:
            row.future.set_result(self.runner.result(row, FinishReason("abort", message="engine stopped")))
        self.runner.reset()
