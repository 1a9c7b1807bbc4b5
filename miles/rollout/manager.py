"""RolloutManager: the rollout side as the orchestrator sees it. It owns the prompt source and the
data buffer and composes the parts that do the work:

    group.py         GroupGenerator: one prompt's samples, generated (partial rollout included), scored
    producer.py      Producer: the fully-async background thread feeding the buffer
    stats.py         SampleStats: rollout/... figures between two reports
    EngineClient     (engine_api/client.py) pause, continue, memory release/resume, aborts

Two ways to produce groups:
- `generate_batch` (sync and one-step-off schedules): one step's prompts, generated together and put
  into the buffer; `collect()` then hands the trainer what passed the buffer's rules.
- `start_producer` (fully async): keeps up to `buffer.max_inflight_groups` groups in flight;
  `collect(n)` blocks for n groups.
Evaluation (eval/accuracy and the eval sets) is miles/eval/evaluator.py's Evaluator, which the
driver hands in as a factory (`evaluator`): chosen there, built here on this process's group
generator. It never imports the trainer, the orchestrator or eval/.
Non-goals: the router and engine health (separate parts).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Literal, Protocol

from miles.buffer.data_buffer import BufferConfig, DataBuffer
from miles.data.prompts import Prompt, PromptSource
from miles.engine_api import routes
from miles.engine_api.aio import run_coroutine
from miles.engine_api.client import EngineClient
from miles.models.loading import load_tokenizer, load_vision
from miles.rollout.config import RolloutConfig
from miles.rollout.generate import get_generate_fn
from miles.rollout.group import GroupGenerator
from miles.rollout.producer import Producer
from miles.rollout.teacher import TeacherScorer
from miles.rewards.runner import RewardRunner


# Admin calls (a pause behind a long step, a memory release) may take a while; connect included.
ADMIN_TIMEOUT_S = 120.0


class Evaluates(Protocol):
    def evaluate(self) -> dict[str, float]:
        """eval/... metrics of the current weights."""


class RolloutManager:
    def __init__(self, cfg: RolloutConfig, model_path: str, engine_urls: list[str], seed: int = 0,
                 buffer_cfg: BufferConfig | None = None, admin_token: str | None = None,
                 router_url: str | None = None, teacher_urls: list[str] | None = None,
                 evaluator: Callable[[GroupGenerator, int], Evaluates] | None = None):
        """`evaluator(groups, seed)` builds what `evaluate()` runs (e.g. partial(Evaluator, eval_cfg));
        None: this manager does not evaluate."""
        self.cfg, self.seed = cfg, seed
        # Its own prompt source: the buffer's ledger must see every prompt it hands out.
        self.buffer = DataBuffer(buffer_cfg or BufferConfig(), PromptSource(cfg.task, "train", seed))
        self.admin = EngineClient(engine_urls, admin_token, ADMIN_TIMEOUT_S, router_url=router_url,
                                  connect_timeout_s=ADMIN_TIMEOUT_S)
        generate_fn = None if cfg.generate_fn == "single_turn" else get_generate_fn(cfg.generate_fn)
        self.groups = GroupGenerator(cfg, seed, load_tokenizer(model_path), RewardRunner(cfg.reward, cfg.reward_config),
                                     generate_fn,
                                     self.buffer, self.admin, threading.Event(),
                                     TeacherScorer(teacher_urls) if teacher_urls else None,
                                     vision=load_vision(model_path))
        self.producer = Producer(self.groups)
        self.evaluator = evaluator(self.groups, seed) if evaluator is not None else None

    # -- generation ------------------------------------------------------------------------------
    def set_versions(self, policy_version: int, weight_version: int | None = None) -> None:
        """The trainer's version (for staleness) and, after a push, the engines' weight version."""
        if weight_version is not None:
            self.buffer.set_weight_version(weight_version)
        self.buffer.set_policy_version(policy_version)

    def generate_batch(self) -> dict[str, float]:
        """Generate one step's prompts together and put every group into the buffer."""
        return self._generate(self.buffer.draw(self.cfg.prompts_per_step))

    def regenerate_in_flight(self) -> dict[str, float]:
        """After a resume: generate again the groups that were in flight when the checkpoint was taken
        (the rest of the batch a one-step-off run was generating; maybe none) and put them into the buffer."""
        return self._generate(self.buffer.draw_resumed())

    def _generate(self, prompts: list[Prompt]) -> dict[str, float]:
        self.groups.samples_done = 0
        t0 = time.perf_counter()

        async def run():
            async with self.admin.async_http(self.cfg.request_timeout_s) as client:
                return await asyncio.gather(*(self.groups.generate_group(client, p) for p in prompts))

        groups = run_coroutine(run())
        for g in groups:
            self.buffer.put(g)
        metrics = self.groups.take_stats(time.perf_counter() - t0)
        samples = [s for g in groups for s in g.samples]
        if samples:
            metrics["rollout/weight_version"] = min(s.oldest_weight_version for s in samples)
            metrics["rollout/off_fleet_samples"] = float(sum(s.off_fleet for s in samples))
        return metrics

    def live_stats(self) -> dict[str, float]:
        """Samples finished so far in the current batch: cheap, for a live progress line."""
        return {"samples": float(self.groups.samples_done)}

    def collect(self, n: int | None = None, timeout: float | None = None):
        """Groups for one training step and the step's rollout and buffer metrics.

        n=None takes every group ready now (after `generate_batch`); otherwise blocks for n groups.
        """
        if self.producer.error is not None:
            raise RuntimeError(f"the rollout producer failed: {self.producer.error!r}")
        groups = self.buffer.get(n, timeout)
        metrics = self.buffer.metrics()
        if self.producer.running:
            metrics.update(self.groups.take_stats(None))
        samples = [s for g in groups for s in g.samples]
        if samples:
            metrics["rollout/trained_reward_mean"] = sum(s.reward for s in samples) / len(samples)
            metrics["rollout/weight_version"] = min(s.oldest_weight_version for s in samples)
            metrics["rollout/off_fleet_samples"] = float(sum(s.off_fleet for s in samples))
        if self.groups.teacher is not None:
            # Teacher engines never receive weights: more than one version seen would be a bug.
            metrics["rollout/teacher_weight_versions"] = len(self.groups.teacher.versions_seen)
        return groups, metrics

    def start_producer(self) -> None:
        """Keep generating in the background until `stop_producer` (fully-async schedule)."""
        self.producer.start()

    def stop_producer(self, timeout: float = 60.0) -> None:
        """Stop admitting prompts, abort what is in flight (those groups are retried), and wait."""
        self.producer.stop(timeout)

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out split (eval/accuracy) and each eval set's eval/<set>/... figures."""
        if self.evaluator is None:
            raise RuntimeError("this RolloutManager was made without an evaluator: pass evaluator=, e.g. "
                               "functools.partial(Evaluator, eval_cfg)")
        return self.evaluator.evaluate()

    def reward_worker_pids(self) -> list[int]:
        """The reward process pool's live workers (rollout.reward_config.num_workers), for fault injection."""
        rewards = self.groups.rewards
        return rewards.worker_pids() if rewards is not None else []

    # -- buffer state ----------------------------------------------------------------------------
    def ledger(self) -> dict[str, int]:
        """The buffer ledger's totals and its event counts (retries and discards by reason); raises if
        any drawn prompt is unaccounted for."""
        return {**self.buffer.ledger.check(), "events": dict(self.buffer.ledger.events)}

    def buffer_state_dict(self) -> dict:
        """The buffer's state with the prompt source's (its position and, for a dataset, the data cursor)."""
        return self.buffer.state_dict()

    def load_buffer_state_dict(self, state: dict) -> None:
        """Go to a checkpoint's buffer and prompt position, from a fresh source: a run restarted in
        place goes back to a position earlier than the one its source has reached."""
        self.buffer.source = PromptSource(self.cfg.task, "train", self.seed)
        self.buffer.load_state_dict(state, Prompt)
        # Fresh draws continue after the last prompt the saved run drew.
        drawn = max((int(i) for i in state["ledger"]["states"]), default=-1) + 1
        source = state.get("source") or {"position": drawn, "task": None}  # older checkpoints: replay
        self.buffer.source.load_state_dict(source)

    # -- engine admin ----------------------------------------------------------------------------
    def engine_memory(self, action: Literal["release", "resume"], tags: list[str] | None = None) -> bool:
        """Colocated turn-taking: ask every engine to release (or take back) its memory (`tags`: the
        kinds, None for all).

        Returns False when the engines do not offer the endpoint, so the caller can say so.
        """
        return self.admin.memory(action, tags)

    def pause_engines(self, mode: str) -> None:
        """Pause every engine for a weight push (abort | retract | in_place, the engine's pause modes)."""
        self.admin.each(routes.PAUSE_GENERATION, {"mode": mode})

    def continue_engines(self) -> None:
        self.admin.each(routes.CONTINUE_GENERATION, {})

    def set_engine_urls(self, urls: list[str]) -> None:
        """The serving engines changed (one replaced, added or removed); admin calls follow them."""
        self.admin.set_urls(urls)
