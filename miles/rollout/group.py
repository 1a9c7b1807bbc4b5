"""Per-group generation: all samples of one prompt, generated, scored (by the reward runner,
miles/rewards/runner.py) and returned as one Group.

Requests for the n samples of one prompt go to the same engine (or through the router as one
batched request), so a prefix cache there can share the prompt. A sample the engine aborts can
resume from its generated prefix (partial rollout): the prefix is sent back as token ids and each
segment records the weight version it ran under. A group that times out or whose engine fails comes
back with `failure` set; buffer.on_failure decides its fate.
Non-goals: which prompts are drawn and when (manager.py, producer.py), admin calls (engine_api/client.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time

import httpx

from miles.buffer.types import Group, Reason, Sample, SampleStatus
from miles.data.chat import encode_prompt
from miles.engine_api.client import EngineClient
from miles.rewards.runner import RewardRunner
from miles.rollout.config import RolloutConfig
from miles.rollout.generate import GenerateContext, GenerationError, SamplingParams, generate, generate_many
from miles.rollout.merge import RequestMerger
from miles.rollout.stats import SampleStats
from miles.rollout.teacher import TeacherScorer

log = logging.getLogger(__name__)


def long_tail_length(max_new_tokens: int, key: int) -> int:
    """A Pareto(1.2)-distributed length in [max_new_tokens/16, max_new_tokens], fixed by `key`.

    Most samples are short and a few are long, the shape that leaves synchronous batches waiting on
    their slowest member.
    """
    lo = max(1, max_new_tokens // 16)
    return min(max_new_tokens, int(lo * random.Random(key).paretovariate(1.2)))


class GroupGenerator:
    """Generates groups for the manager's batches, the producer and (through `encode`, `context`)
    evaluation. `stopping` set means the run is winding down: no sample is resumed, no failed group
    waits for the router."""

    def __init__(self, cfg: RolloutConfig, seed: int, tokenizer, rewards: RewardRunner | None, generate_fn, buffer,
                 admin: EngineClient, stopping: threading.Event, teacher: TeacherScorer | None = None,
                 vision=None):
        self.cfg, self.seed, self.tokenizer = cfg, seed, tokenizer
        self.vision = vision  # a vision-language model's VisionProcessor (models/vision.py), else None
        self.rewards = rewards
        # The `(response, label) -> float` view of the runner, for ctx.reward_fn.
        self.reward_fn = rewards.score_text if rewards is not None else None
        # None keeps the built-in path below. A plugged-in generate function fills in its samples'
        # rewards itself unless it declares `scores_itself = False`; then the runner scores them.
        self.generate_fn = generate_fn
        self._runner_scores = generate_fn is None or not getattr(generate_fn, "scores_itself", True)
        self.buffer, self.admin, self.stopping = buffer, admin, stopping
        self.teacher = teacher  # teacher engines scoring each group (on-policy distillation), or None
        self.stats = SampleStats()
        self.samples_done = 0  # samples finished in the current batch, for the live progress line
        self._lock = threading.Lock()
        self._next_engine = 0
        self._failures_seen: set[str] = set()
        # A batch bound for the router is split over the engines behind it, so its balancing still spreads it.
        self.merger = RequestMerger(lambda url: len(self.admin.urls) if url == self.admin.router_url else 1,
                                    cfg.return_routed_experts)

    def merges(self, prompt) -> bool:
        """Whether `prompt`'s batched requests share a POST with others ready at once (rollout/merge.py)."""
        return self.cfg.batch_requests and self.cfg.merge_requests and not prompt.images

    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt (a Prompt, or its text): messages go through the chat template."""
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, self.cfg.task, prompt)
        return encode_prompt(self.tokenizer, self.cfg.task, prompt.text, prompt.messages, prompt.images, self.vision)

    def take_stats(self, elapsed: float | None) -> dict[str, float]:
        stats, self.stats = self.stats, SampleStats()
        metrics = stats.metrics(elapsed)
        if self.rewards is not None:
            metrics.update(self.rewards.take_metrics())
        # A generate function with figures of its own (the harness's episode and failure counts).
        take = getattr(self.generate_fn, "take_metrics", None)
        if take is not None:
            metrics.update(take())
        return metrics

    def context(self, client, url: str) -> GenerateContext:
        return GenerateContext(client, url, self.tokenizer, self.encode, self.reward_fn, self.cfg.agent,
                               self.cfg.return_routed_experts, self.vision)

    def sampling_params(self, prompt_index: int, k: int) -> SamplingParams:
        cfg = self.cfg
        # A seed per sample makes a run reproducible regardless of batching inside the engine.
        seed = hash((self.seed, prompt_index, k)) & 0x7FFFFFFF
        length = cfg.max_new_tokens
        if cfg.response_lengths == "long_tail":
            length = long_tail_length(cfg.max_new_tokens, seed)
        return SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, length, seed=seed,
                              ignore_eos=cfg.response_lengths == "long_tail")

    async def generate_group(self, client, prompt) -> Group:
        """All samples of one prompt, scored; a Group with `failure` set if generation gave up."""
        with self._lock:
            url = self.admin.router_url or self.admin.urls[self._next_engine % len(self.admin.urls)]
            self._next_engine += 1
        rids: list[str] = []
        if self.generate_fn is None:
            work = self._generate_samples(client, url, self.encode(prompt), prompt, rids)
        else:
            work = asyncio.gather(*(self._counted(self._generate_sample(client, url, prompt, k, rids))
                                    for k in range(self.cfg.n_samples_per_prompt)))
        t0 = time.perf_counter()
        try:
            if self.cfg.group_timeout_s > 0:
                samples = await asyncio.wait_for(work, self.cfg.group_timeout_s)
            else:
                samples = await work
            if self.teacher is not None and not any(s.status is SampleStatus.ABORTED for s in samples):
                # Part of the rollout, so it overlaps with training as generation does under every schedule.
                await self.teacher.score_group(client, samples)
        except (asyncio.TimeoutError, TimeoutError, httpx.TimeoutException):
            await self.admin.abort_rids(client, url, rids)
            return Group(samples=[], prompt_index=prompt.index, failure=Reason.TIMEOUT)
        except (httpx.HTTPError, GenerationError, OSError) as exc:
            why = str(exc)[:400]
            if why not in self._failures_seen:  # each distinct cause once, not once per group
                self._failures_seen.add(why)
                log.warning("a group of prompt %d failed and goes to buffer.on_failure: %s", prompt.index, why)
            await self.admin.abort_rids(client, url, rids)
            if self.admin.router_url:
                await self.admin.wait_for_router(client, self.cfg.request_timeout_s, self.stopping)
            return Group(samples=[], prompt_index=prompt.index, failure=Reason.ENGINE_FAILURE)
        if any(s.status is SampleStatus.ABORTED for s in samples):
            return Group(samples=[], prompt_index=prompt.index, failure=Reason.ABORTED)
        if self._runner_scores:
            with self.stats.scoring():
                kept = await self.rewards.score_group(samples, prompt.text, prompt.metadata)
            if not kept:  # a reward call failed and rollout.reward_config.on_error = drop_group
                return Group(samples=[], prompt_index=prompt.index, failure=Reason.REWARD_ERROR)
        group = Group(samples=samples, prompt_index=prompt.index)
        self.stats.add(group, time.perf_counter() - t0)
        return group

    async def _counted(self, sample_coro):
        sample = await sample_coro
        self.samples_done += 1  # only the event loop's thread writes it
        return sample

    async def _generate_samples(self, client, url, prompt_ids, prompt, rids: list[str]) -> list[Sample]:
        """The group's samples in one batched request (or one request each, with batch_requests off);
        with partial rollout, the aborted ones resume from their generated prefixes, again together."""
        n = self.cfg.n_samples_per_prompt
        params = [self.sampling_params(prompt.index, k) for k in range(n)]
        response: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        off_fleet = [False] * n
        last: list = [None] * n
        todo, segment = list(range(n)), 0
        while todo:
            # The engine reports the version of a segment's last token; the version it held when the
            # request went out bounds the first token's from below, so staleness is never understated.
            known = self.buffer.weight_version
            seg_rids = [f"p{prompt.index}-{k}-{time.monotonic_ns()}-{segment}" for k in todo]
            rids.extend(seg_rids)
            seg_params = [dataclasses.replace(params[k], max_new_tokens=params[k].max_new_tokens - len(response[k]),
                                              seed=None if params[k].seed is None else params[k].seed + segment)
                          for k in todo]
            prompts = [prompt_ids + response[k] for k in todo]
            outs = await self._request(client, url, prompts, seg_params, seg_rids, prompt)
            resume = []
            for k, s in zip(todo, outs):
                response[k] += s.response_ids
                logprobs[k] += s.rollout_logprobs
                versions[k].append(min(known, s.oldest_weight_version))
                # Every engine serving held `known` or newer when the request went out (a version is
                # known once the fleet committed it): an older one is an engine behind the fleet.
                off_fleet[k] = off_fleet[k] or s.oldest_weight_version < known
                last[k] = s
                if (s.status is SampleStatus.ABORTED and self.cfg.partial_rollout and segment < self.cfg.max_resumes
                        and len(response[k]) < params[k].max_new_tokens and not self.stopping.is_set()):
                    resume.append(k)
                else:
                    self.samples_done += 1  # only the event loop's thread writes it
            todo, segment = resume, segment + 1
        samples = []
        for k in range(n):
            s = last[k]
            text = s.response_text if len(versions[k]) == 1 else self.tokenizer.decode(response[k],
                                                                                        skip_special_tokens=True)
            status = s.status
            if status is SampleStatus.ABORTED and len(response[k]) >= params[k].max_new_tokens:
                status = SampleStatus.TRUNCATED
            # The last segment's request held the whole prefix, so its routing covers every earlier segment.
            samples.append(Sample(prompt_ids=list(prompt_ids), response_ids=response[k], rollout_logprobs=logprobs[k],
                                  loss_mask=[1] * len(response[k]), status=status, weight_versions=versions[k],
                                  response_text=text, label=prompt.label, prompt_index=prompt.index,
                                  routed_experts=s.routed_experts, metadata=dict(prompt.metadata),
                                  off_fleet=off_fleet[k], images=prompt.images))
        return samples

    async def _request(self, client, url, prompts, params, rids, prompt) -> list[Sample]:
        """One segment: every prompt in one batched /generate, or one request each."""
        routed = self.cfg.return_routed_experts
        if not self.cfg.batch_requests:
            return await asyncio.gather(*(
                generate(client, url, ids, sp, rid=rid, label=prompt.label, prompt_index=prompt.index,
                         return_routed_experts=routed, images=prompt.images, vision=self.vision)
                for ids, sp, rid in zip(prompts, params, rids)))
        try:
            if self.merges(prompt):
                return await self.merger.generate(client, url, prompts, params, rids, prompt.label, prompt.index)
            return await generate_many(client, url, prompts, params, rids=rids, label=prompt.label,
                                       prompt_index=prompt.index, return_routed_experts=routed,
                                       images=prompt.images, vision=self.vision)
        except GenerationError as exc:
            if " 422:" not in str(exc):
                raise
            raise GenerationError(f"{exc} (a server that takes one prompt per request, such as the Rust "
                                  "sglang-router, refuses batched requests: set "
                                  "rollout.batch_requests = false)") from None

    async def _generate_sample(self, client, url, prompt, k: int, rids: list[str]) -> Sample:
        """One sample from the configured custom generate function."""
        params = self.sampling_params(prompt.index, k)
        rids.append(f"p{prompt.index}-{k}-{time.monotonic_ns()}")
        return await self.generate_fn(self.context(client, url), prompt, params, rids[-1])
