"""The reward runner: the one place generated samples are scored.

It scores a group's samples with the run's reward (or each component of `weighted`): `async def`
rewards and those declared inline (cheap, cannot block) on the event loop, other sync ones in a
thread, or every sync one in a process pool with `reward_config.num_workers`. Every call but an
inline one has a timeout. A call that raises or times out is counted (`reward/errors`,
`reward/timeouts`) and its samples get the fallback score, or their group is dropped; once the
share of failed calls passes `max_error_rate` the run stops with the reward's own traceback and the
offending sample (RewardError). Each sample gets its score and, when the reward says it, whether it
is right (Sample.correct: a dict's `correct`, else the reward's declared correct_threshold; for
`weighted`, right when every component that says so says right; a failed call never says right).
Per step it reports `reward/calls`, `reward/errors`,
`reward/timeouts`, the mean of every extra number a dict-valued reward returns (`reward/<key>`) and,
for `weighted`, each component's mean score (`reward/<component>`).

Non-goals: which samples are generated (group.py); a hung sync reward in a thread is abandoned, not
killed (threads cannot be): a reward that may hang belongs in the process pool, whose workers are
killed and replaced on a timeout. A pool worker that dies is replaced too, and the calls it broke
are made again (`reward/worker_restarts`): a killed reward worker costs time, not scores.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.process
import math
import multiprocessing
import os
import signal
import threading
import traceback
from collections import defaultdict

from miles.buffer.types import Sample
from miles.rewards.config import RewardConfig
from miles.rewards.contract import Reward, RewardInput, Scored, load_components, load_reward


class RewardError(RuntimeError):
    """The reward failed on more than reward_config.max_error_rate of its calls."""


def _correct_of(value, name: str) -> bool:
    """A dict's `correct` as a bool: True/False or 1/0 (numpy and torch scalars too); TypeError otherwise."""
    try:
        number = None if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        number = None
    if number not in (0.0, 1.0):
        raise TypeError(f"reward {name!r} returned correct = {value!r}; return True or False (or 1 or 0)")
    return number == 1.0


def _score_of(value, reward: Reward) -> tuple[Scored, dict[str, float]]:
    """A reward's return value as (score and verdict, extra metrics); TypeError naming the contract otherwise."""
    name, correct = reward.name, None
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"reward {name!r} returned a dict without 'score' ({sorted(value)}); return "
                            "{'score': float, ...other numbers}")
        if "correct" in value:
            correct = _correct_of(value["correct"], name)
        extras = {k: float(v) for k, v in value.items() if k != "score"}
        value = value["score"]
    else:
        extras = {}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            raise TypeError(f"reward {name!r} returned {type(value).__name__}; return a float or a dict with "
                            "'score'") from None
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward {name!r} returned {score}; return a finite float")
    if correct is None and reward.correct_threshold is not None:
        correct = score >= reward.correct_threshold
    return Scored(score, correct), extras


def _arguments(reward: Reward, inputs: list[RewardInput]) -> tuple:
    """The positional arguments of one call of `reward` on `inputs` (one input unless batched)."""
    if reward.takes_sample:
        return (inputs,) if reward.batched else (inputs[0],)
    if reward.batched:
        return [i.response for i in inputs], [i.label for i in inputs]
    return inputs[0].response, inputs[0].label


def _invoke(reward: Reward, args: tuple):
    """Call a reward to completion in this thread (an async one on its own loop)."""
    out = reward.fn(*args)
    if reward.is_async or asyncio.iscoroutine(out):
        out = asyncio.run(out) if asyncio.iscoroutine(out) else out
    return out


_WORKER_REWARDS: dict[str, Reward] = {}  # in a pool process: each reward loaded once


def _worker_reward(spec: str, cfg: RewardConfig | None) -> Reward:
    if spec not in _WORKER_REWARDS:
        _WORKER_REWARDS[spec] = load_reward(spec, cfg)
    return _WORKER_REWARDS[spec]


def _worker_call(spec: str, cfg: RewardConfig | None, args: tuple):
    """In a pool process: load the reward once, call it; a failure comes back with its traceback text."""
    try:
        return True, _invoke(_worker_reward(spec, cfg), args)
    except BaseException as e:  # the traceback text survives pickling, the traceback object does not
        return False, (f"{type(e).__name__}: {e}", traceback.format_exc())


class _Failure(Exception):
    def __init__(self, kind: str, message: str, tb: str):
        super().__init__(message)
        self.kind, self.tb = kind, tb


_POOL_ATTEMPTS = 3  # a call whose pool broke under it this many times in a row fails (reward/errors)


class RewardRunner:
    """Scores groups of samples with the run's reward; `take_metrics` hands over the step's figures."""

    def __init__(self, spec: str, cfg: RewardConfig | None = None):
        self.spec, self.cfg = spec, cfg or RewardConfig()
        self.components = load_components(spec, self.cfg)
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="reward")
        # score_text's own loops, apart from the calls they wait on (one pool could wait on itself).
        self._loops = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward-loop")
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.calls = self.failed = 0  # over the whole run, for max_error_rate
        self._reset()

    def _reset(self) -> None:
        self._m = {"calls": 0, "errors": 0, "timeouts": 0, "worker_restarts": 0}
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    # -- scoring ---------------------------------------------------------------------------------
    async def score_group(self, samples: list[Sample], prompt_text: str = "", metadata: dict | None = None) -> bool:
        """Set every sample's reward; False when a failure drops the group (on_error = drop_group).
        `metadata` is the prompt's; a sample's own metadata entries take precedence."""
        inputs = [RewardInput(prompt=prompt_text, response=s.response_text, label=s.label,
                              response_ids=list(s.response_ids), prompt_ids=list(s.prompt_ids),
                              metadata={**(metadata or {}), **s.metadata}) for s in samples]
        for i in inputs:
            i.group = inputs
        scored, keep = await self.score_inputs(inputs)
        for s, x in zip(samples, scored):
            s.reward, s.correct = x.score, x.correct
        return keep

    async def score_inputs(self, inputs: list[RewardInput]) -> tuple[list[Scored], bool]:
        """Each input's weighted sum of the components' scores and their verdict, and whether the group
        stays. A sample is right when every component that says so says right; None when none says."""
        total = [0.0] * len(inputs)
        verdicts: list[list[bool]] = [[] for _ in inputs]
        keep = True
        for reward, weight in self.components:
            scored, ok = await self._score_component(reward, inputs)
            keep = keep and ok
            for k, x in enumerate(scored):
                total[k] += weight * x.score
                if x.correct is not None:
                    verdicts[k].append(x.correct)
            if len(self.components) > 1:
                self._add_means({reward.name: [x.score for x in scored]})
        return [Scored(t, all(v) if v else None) for t, v in zip(total, verdicts)], keep

    async def _score_component(self, reward: Reward, inputs: list[RewardInput]) -> tuple[list[Scored], bool]:
        batches = [inputs] if reward.batched else [[i] for i in inputs]
        results = await asyncio.gather(*(self._call(reward, b) for b in batches))
        scored, keep, extras = [], True, defaultdict(list)
        for batch, result in zip(batches, results):
            if isinstance(result, _Failure):
                keep = keep and self.cfg.on_error != "drop_group"
                # A call that failed cannot vouch for its samples: the fallback score, never right.
                scored += [Scored(self.cfg.fallback_score, False)] * len(batch)
                continue
            for x, more in result:
                scored.append(x)
                for k, v in more.items():
                    extras[k].append(v)
        self._add_means(extras)
        return scored, keep

    async def _call(self, reward: Reward, batch: list[RewardInput]):
        """One reward call: its (Scored, extras) per input, or a counted _Failure."""
        args = _arguments(reward, batch)
        loop = asyncio.get_running_loop()
        try:
            if self.cfg.num_workers > 0 and not reward.is_async:
                ok, out = await self._in_pool(reward, args)
                if not ok:
                    raise _Failure("errors", out[0], out[1])
            elif reward.is_async:
                out = await asyncio.wait_for(reward.fn(*args), self.cfg.timeout_s)
            elif reward.inline:
                out = reward.fn(*args)
            else:
                out = await asyncio.wait_for(loop.run_in_executor(self._threads, reward.fn, *args), self.cfg.timeout_s)
            values = list(out) if reward.batched else [out]
            if len(values) != len(batch):
                raise ValueError(f"batched reward {reward.name!r} returned {len(values)} values for "
                                 f"{len(batch)} samples; return one per sample")
            result = [_score_of(v, reward) for v in values]
        except (asyncio.TimeoutError, TimeoutError):
            if self.cfg.num_workers > 0 and not reward.is_async:
                self._kill_pool()
            failure = _Failure("timeouts", f"reward {reward.name!r} took longer than "
                               f"rollout.reward_config.timeout_s = {self.cfg.timeout_s}", "")
            self._count(failure, batch)
            return failure
        except _Failure as failure:
            self._count(failure, batch)
            return failure
        except Exception as e:
            failure = _Failure("errors", f"{type(e).__name__}: {e}", traceback.format_exc())
            self._count(failure, batch)
            return failure
        self._count(None, batch)
        return result

    async def _in_pool(self, reward: Reward, args: tuple) -> tuple:
        """One call in a pool worker. A worker that dies (killed from outside, out of memory) breaks the
        whole pool: the pool is replaced and the call made again, so the samples still get their real
        score (counted in reward/worker_restarts, not reward/errors)."""
        loop = asyncio.get_running_loop()
        for attempt in range(_POOL_ATTEMPTS):
            pool = self._process_pool()
            try:
                return await asyncio.wait_for(
                    loop.run_in_executor(pool, _worker_call, reward.name, self.cfg, args), self.cfg.timeout_s)
            except concurrent.futures.process.BrokenProcessPool:
                self._replace_broken(pool)
                if attempt == _POOL_ATTEMPTS - 1:
                    raise

    def _replace_broken(self, pool) -> None:
        with self._lock:
            if self._pool is not pool:  # another call already replaced it
                return
            self._m["worker_restarts"] += 1
        self._kill_pool()

    def _count(self, failure: _Failure | None, batch: list[RewardInput]) -> None:
        with self._lock:
            self._m["calls"] += 1
            self.calls += 1
            if failure is None:
                return
            self._m[failure.kind] += 1
            self.failed += 1
            rate = self.failed / self.calls
            if self.calls >= self.cfg.min_calls and rate > self.cfg.max_error_rate:
                sample = batch[0]
                raise RewardError(
                    f"the reward failed on {self.failed} of {self.calls} calls ({rate:.0%}), more than "
                    f"rollout.reward_config.max_error_rate = {self.cfg.max_error_rate}; fix the reward or raise "
                    f"the threshold.\nLast failure: {failure}\n{failure.tb}\nOffending sample: "
                    f"prompt={sample.prompt!r} response={sample.response!r} label={sample.label!r} "
                    f"metadata={sample.metadata!r}")

    def _add_means(self, values: dict[str, list[float]]) -> None:
        with self._lock:
            for k, vs in values.items():
                self._sums[k] += sum(vs)
                self._counts[k] += len(vs)

    def score_text(self, response: str, label=None) -> float:
        """The `(response, label) -> float` view of the runner, callable from any thread (also one
        running an event loop): what generate functions' `ctx.reward_fn` call."""
        return self.judge_text(response, label).score

    def judge_text(self, response: str, label=None) -> Scored:
        """One response's score and verdict, callable from any thread (also one running an event
        loop): what evaluation calls."""
        inputs = [RewardInput(prompt="", response=response, label=label)]
        inputs[0].group = inputs
        run = lambda: asyncio.run(self.score_inputs(inputs))  # noqa: E731
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return run()[0][0]
        return self._loops.submit(run).result()[0][0]

    # -- metrics and lifetime --------------------------------------------------------------------
    def take_metrics(self) -> dict[str, float]:
        """reward/calls, reward/errors, reward/timeouts, reward/worker_restarts and the means of extra
        metrics since the last call."""
        with self._lock:
            out = {f"reward/{k}": float(v) for k, v in self._m.items()}
            out.update({f"reward/{k}": self._sums[k] / n for k, n in self._counts.items() if n})
            self._reset()
        return out

    def worker_pids(self) -> list[int]:
        """The process ids of the pool's live workers (none before the first pooled call)."""
        with self._lock:
            pool = self._pool
        return sorted(getattr(pool, "_processes", None) or {}) if pool is not None else []

    def _process_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the rollout process runs threads and an event loop, which fork would copy half-way.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.cfg.num_workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def _kill_pool(self) -> None:
        """A worker is stuck on a call past its timeout: kill the pool's processes and start afresh."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for pid in list(getattr(pool, "_processes", {}) or {}):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._kill_pool()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._loops.shutdown(wait=False, cancel_futures=True)
