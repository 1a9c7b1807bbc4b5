"""RolloutManager: owns the prompt source and the data buffer, talks to the engines, scores samples.

It never imports the trainer or the orchestrator. Two ways to produce groups:
- `generate_batch` (sync and one-step-off schedules): one step's prompts, generated together and put
  into the buffer; `collect()` then hands the trainer what passed the buffer's rules.
- `start_producer` (fully async): a background thread keeps up to `buffer.max_inflight_groups`
  groups in flight and puts each into the buffer as it finishes; `collect(n)` blocks for n groups.
Requests for the n samples of one prompt go to the same engine, so a prefix cache there can share
the prompt. A sample the engine aborts can resume from its generated prefix (partial rollout): the
prefix is sent back as token ids and each segment records the weight version it ran under.
Non-goals here: the router and health monitoring (separate parts).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from miles.rollout.agent import AgentConfig
from miles.rollout.data_source import TaskConfig

log = logging.getLogger(__name__)


@dataclass
class RolloutConfig:
    num_engines: int = 1
    """Built-in engine processes to start (ignored when engine_urls is set)."""
    engine_urls: list[str] = field(default_factory=list)
    """Engines already running (SGLang servers or `miles serve`) to generate with and push weights to,
    instead of starting built-in ones. The run neither starts nor stops them. Their admin token
    (SGLang's --api-key), if any, is read from the environment variable MILES_ENGINE_ADMIN_TOKEN so
    that it never lands in the saved run config."""
    pd_disaggregation: bool = False
    """The engines at engine_urls serve prefill and decode on separate workers (SGLang PD
    disaggregation); weight updates must then reach both kinds, which not every transport can do."""
    engine_dtype: str = "float32"
    """Engine weights/compute dtype: float32 or bfloat16 (bfloat16 engines route some tokens of an MoE
    model to other experts than a float32 trainer would)."""
    engine_max_batch_size: int = 256
    """Most sequences an engine decodes together."""
    engine_num_threads: int = 1
    """torch threads per engine process."""
    prompts_per_step: int = 32
    """Prompts (groups) per training step."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (the group size)."""
    temperature: float = 1.0
    """Sampling temperature for rollouts; the trainer's logprobs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_new_tokens: int = 16
    """Longest response in tokens."""
    return_routed_experts: bool = False
    """Ask the engines for the experts each token was routed to (MoE models) and keep them on the
    samples: the trainer then reports the routing mismatch, and can replay them (trainer.routing_replay)."""
    reward: str = "exact_match"
    """Reward function by name or module:function."""
    request_timeout_s: float = 300.0
    """Give up on one /generate after this many seconds."""
    batch_requests: bool = True
    """Send a group's samples as one batched /generate (SGLang's list form). Set false when
    engine_urls name a server that takes one prompt per request, such as the Rust sglang-router."""
    group_timeout_s: float = 0.0
    """Give up on a whole group after this many seconds (0 = never); buffer.on_failure decides its fate."""
    partial_rollout: bool = False
    """Resume a sample the engine aborted from its generated prefix instead of failing its group."""
    max_resumes: int = 2
    """Most times one sample is resumed after an abort (partial_rollout)."""
    response_lengths: Literal["natural", "long_tail"] = "natural"
    """natural: stop at EOS; long_tail: each sample's length is drawn from a heavy-tailed law up to
    max_new_tokens and EOS is ignored (controlled workloads for benchmarks)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Where prompts come from."""
    generate_fn: str = "single_turn"
    """How a prompt becomes a scored sample: single_turn, agent (multi-turn episodes), or module:function."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn episodes (generate_fn = "agent"): environment, turn/token budgets, episode timeout."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.num_engines < 1:
            raise ConfigError("rollout.num_engines must be >= 1")
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"rollout.engine_urls: {url!r} is not an http(s) URL; give each engine's base "
                                  "URL, e.g. http://10.0.0.5:30000")
        if self.pd_disaggregation and not self.engine_urls:
            raise ConfigError("rollout.pd_disaggregation: the built-in engine serves prefill and decode in one "
                              "process; point rollout.engine_urls at SGLang PD-disaggregated servers or set "
                              "rollout.pd_disaggregation = false")
        if self.n_samples_per_prompt < 1 or self.prompts_per_step < 1:
            raise ConfigError("rollout.n_samples_per_prompt and rollout.prompts_per_step must be >= 1")
        if self.temperature <= 0:
            raise ConfigError("rollout.temperature must be > 0 for RL sampling (greedy rollouts give no "
                              "variance within a group)")
        if not 0 < self.top_p <= 1:
            raise ConfigError("rollout.top_p must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ConfigError("rollout.max_new_tokens must be >= 1")
        if self.group_timeout_s < 0 or self.max_resumes < 0:
            raise ConfigError("rollout.group_timeout_s and rollout.max_resumes must be >= 0")
        if self.engine_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("rollout.engine_dtype must be float32, bfloat16 or float16")
        from miles.rollout.agent import get_generate_fn

        try:
            get_generate_fn(self.generate_fn)
        except ValueError as e:
            raise ConfigError(f"rollout.generate_fn: {e}") from None
        from miles.rollout.reward import get_reward_fn

        try:
            get_reward_fn(self.reward)
        except ValueError as e:
            raise ConfigError(f"rollout.reward: {e}") from None


@dataclass
class EvalConfig:
    every_steps: int = 10
    """Evaluate every this many steps (0 = only before and after training)."""
    num_prompts: int = 256
    """Held-out prompts per evaluation (greedy decoding)."""
    max_new_tokens: int = 16
    """Longest eval response in tokens."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.every_steps < 0 or self.num_prompts < 1:
            raise ConfigError("eval.every_steps must be >= 0 and eval.num_prompts >= 1")


def run_coroutine(coro):
    """asyncio.run on a fresh thread: a threaded Ray actor may call us from a thread whose event loop
    is already running, where asyncio.run refuses to start."""
    out: dict = {}

    def main():
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=main, name="rollout-io")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


async def _run_all(jobs, timeout_s: float):
    # Kept outside the class: an `async def` method would make Ray run the actor as an async actor.
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        return await asyncio.gather(*(job(client) for job in jobs))


def long_tail_length(max_new_tokens: int, key: int) -> int:
    """A Pareto(1.2)-distributed length in [max_new_tokens/16, max_new_tokens], fixed by `key`.

    Most samples are short and a few are long, the shape that leaves synchronous batches waiting on
    their slowest member.
    """
    import random

    lo = max(1, max_new_tokens // 16)
    return min(max_new_tokens, int(lo * random.Random(key).paretovariate(1.2)))


class RolloutManager:
    def __init__(self, cfg: RolloutConfig, eval_cfg: EvalConfig, model_path: str, engine_urls: list[str],
                 seed: int = 0, buffer_cfg=None, admin_token: str | None = None, cores=None,
                 router_url: str | None = None):
        if cores:
            # The manager's HTTP and scoring work belongs to the rollout side's cores, not the trainer's.
            from miles.orchestration.placement import pin_current_process

            pin_current_process(tuple(cores))
        from miles.buffer.data_buffer import BufferConfig, DataBuffer
        from miles.models.loading import load_tokenizer
        from miles.rollout.data_source import PromptSource
        from miles.rollout.reward import get_reward_fn

        self.cfg, self.eval_cfg, self.seed = cfg, eval_cfg, seed
        self.engine_urls = list(engine_urls)  # admin calls (pause, abort, memory) go to each engine
        # Generation goes through the router when there is one: it spreads load and retries a request
        # whose engine died before answering on a live engine.
        self.router_url = router_url
        self._failures_seen: set[str] = set()
        self.tokenizer = load_tokenizer(model_path)
        self.reward_fn = get_reward_fn(cfg.reward)
        from miles.rollout.agent import get_generate_fn

        # A plugged-in generate function scores its own samples; None keeps the built-in path below.
        self.generate_fn = None if cfg.generate_fn == "single_turn" else get_generate_fn(cfg.generate_fn)
        self.source = PromptSource(cfg.task, "train", seed)
        self.eval_prompts = PromptSource(cfg.task, "eval", seed).take(eval_cfg.num_prompts)
        self._next_engine = 0
        self._step = 0
        self.admin_token = admin_token
        # Its own prompt source: the buffer's ledger must see every prompt it hands out.
        self.buffer = DataBuffer(buffer_cfg or BufferConfig(), PromptSource(cfg.task, "train", seed))
        self._lock = threading.Lock()
        self._stats = _SampleStats()
        self._samples_done = 0  # samples finished in the current batch, for the live progress line
        self._producer: threading.Thread | None = None
        self._stopping = threading.Event()
        self._producer_error: BaseException | None = None

    def _encode(self, text: str) -> list[int]:
        if self.cfg.task.apply_chat_template:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                           add_generation_prompt=True, tokenize=True))
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def generate_groups(self):
        """One step's worth of groups: prompts_per_step prompts × n_samples_per_prompt samples."""
        from miles.buffer.types import Group
        from miles.rollout.generate import SamplingParams, generate

        cfg = self.cfg
        prompts = self.source.take(cfg.prompts_per_step)
        t0 = time.perf_counter()
        jobs = []
        for p in prompts:
            url = self.engine_urls[self._next_engine % len(self.engine_urls)]
            self._next_engine += 1
            ids = self._encode(p.text)
            for k in range(cfg.n_samples_per_prompt):
                # A seed per sample makes a run reproducible regardless of batching inside the engine.
                params = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens,
                                        seed=hash((self.seed, p.index, k)) & 0x7FFFFFFF)
                jobs.append(lambda c, url=url, ids=ids, p=p, params=params, k=k: generate(
                    c, url, ids, params, rid=f"s{self._step}-p{p.index}-{k}", label=p.label, prompt_index=p.index,
                    return_routed_experts=cfg.return_routed_experts))
        samples = run_coroutine(_run_all(jobs, self.cfg.request_timeout_s))
        elapsed = time.perf_counter() - t0
        for s in samples:
            s.reward = float(self.reward_fn(s.response_text, s.label))
        reward_s = time.perf_counter() - t0 - elapsed
        n = cfg.n_samples_per_prompt
        groups = [Group(samples=samples[i:i + n]) for i in range(0, len(samples), n)]
        self._step += 1
        resp_tokens = sum(len(s.response_ids) for s in samples)
        metrics = {
            "rollout/reward_mean": sum(s.reward for s in samples) / len(samples),
            "rollout/response_len_mean": resp_tokens / len(samples),
            "rollout/truncated_frac": sum(s.status.value == "truncated" for s in samples) / len(samples),
            "rollout/zero_std_group_frac": sum(len(set(g.rewards)) == 1 for g in groups) / len(groups),
            "rollout/time_s": elapsed,
            "rollout/samples_per_s": len(samples) / elapsed,
            "rollout/tokens_per_s": resp_tokens / elapsed,
            "rollout/weight_version": min(s.oldest_weight_version for s in samples),
            "perf/reward_s": reward_s,
        }
        return groups, metrics

    # -- buffered generation ---------------------------------------------------------------------
    def set_versions(self, policy_version: int, weight_version: int | None = None) -> None:
        """The trainer's version (for staleness) and, after a push, the engines' weight version."""
        if weight_version is not None:
            self.buffer.set_weight_version(weight_version)
        self.buffer.set_policy_version(policy_version)

    def generate_batch(self) -> dict[str, float]:
        """Generate one step's prompts together and put every group into the buffer."""
        prompts = self.buffer.draw(self.cfg.prompts_per_step)
        self._samples_done = 0
        t0 = time.perf_counter()

        async def run():
            import httpx

            async with httpx.AsyncClient(timeout=self.cfg.request_timeout_s, limits=_limits()) as client:
                return await asyncio.gather(*(self._generate_group(client, p) for p in prompts))

        groups = run_coroutine(run())
        for g in groups:
            self.buffer.put(g)
        metrics = self._take_stats(time.perf_counter() - t0)
        samples = [s for g in groups for s in g.samples]
        if samples:
            metrics["rollout/weight_version"] = min(s.oldest_weight_version for s in samples)
        return metrics

    def live_stats(self) -> dict[str, float]:
        """Samples finished so far in the current batch: cheap, for a live progress line."""
        return {"samples": float(self._samples_done)}

    async def _counted(self, sample_coro):
        sample = await sample_coro
        self._samples_done += 1  # only the event loop's thread writes it
        return sample

    def collect(self, n: int | None = None, timeout: float | None = None):
        """Groups for one training step and the step's rollout and buffer metrics.

        n=None takes every group ready now (after `generate_batch`); otherwise blocks for n groups.
        """
        if self._producer_error is not None:
            raise RuntimeError(f"the rollout producer failed: {self._producer_error!r}")
        groups = self.buffer.get(n, timeout)
        metrics = self.buffer.metrics()
        if self._producer is not None:
            metrics.update(self._take_stats(None))
        samples = [s for g in groups for s in g.samples]
        if samples:
            metrics["rollout/trained_reward_mean"] = sum(s.reward for s in samples) / len(samples)
            metrics["rollout/weight_version"] = min(s.oldest_weight_version for s in samples)
        return groups, metrics

    def start_producer(self) -> None:
        """Keep generating in the background until `stop_producer` (fully-async schedule)."""
        if self._producer is not None:
            return
        self._stopping.clear()
        self.buffer.reopen()
        self._stats = _SampleStats()
        self._producer = threading.Thread(target=self._producer_main, name="rollout-producer", daemon=True)
        self._producer.start()

    def stop_producer(self, timeout: float = 60.0) -> None:
        """Stop admitting prompts, abort what is in flight (those groups are retried), and wait."""
        if self._producer is None:
            return
        self._stopping.set()
        self.buffer.close()
        self._producer.join(timeout)
        self._producer = None
        self.buffer.reopen()

    def ledger(self) -> dict[str, int]:
        """The buffer ledger's totals and its event counts (retries and discards by reason); raises if
        any drawn prompt is unaccounted for."""
        return {**self.buffer.ledger.check(), "events": dict(self.buffer.ledger.events)}

    def buffer_state_dict(self) -> dict:
        return self.buffer.state_dict()

    def load_buffer_state_dict(self, state: dict) -> None:
        from miles.rollout.data_source import Prompt

        self.buffer.load_state_dict(state, Prompt)
        # Fresh draws continue after the last prompt the saved run drew.
        drawn = max((int(i) for i in state["ledger"]["states"]), default=-1) + 1
        while self.buffer.source.position < drawn:
            self.buffer.source.take(1)

    def engine_memory(self, action: Literal["release", "resume"]) -> bool:
        """Colocated turn-taking: ask every engine to release (or take back) its memory.

        Returns False when the engines do not offer the endpoint, so the caller can say so.
        """
        import httpx

        headers = self._admin_headers()
        ok = True
        for url in self.engine_urls:
            r = httpx.post(f"{url}/{action}_memory_occupation", json={}, headers=headers, timeout=120)
            if r.status_code == 404:
                ok = False
            elif r.status_code != 200:
                raise RuntimeError(f"{url}/{action}_memory_occupation answered {r.status_code}: {r.text[:200]}")
        return ok

    def pause_engines(self, mode: str) -> None:
        """Pause every engine for a weight push (abort | retract | in_place, the engine's pause modes)."""
        self._engine_call("pause_generation", {"mode": mode})

    def continue_engines(self) -> None:
        self._engine_call("continue_generation", {})

    def set_engine_urls(self, urls: list[str]) -> None:
        """The serving engines changed (one replaced, added or removed); admin calls follow them."""
        self.engine_urls = list(urls)

    def _engine_call(self, endpoint: str, body: dict) -> None:
        import httpx

        for url in list(self.engine_urls):
            try:
                r = httpx.post(f"{url}/{endpoint}", json=body, headers=self._admin_headers(), timeout=120)
            except httpx.TransportError:
                if self.router_url is None:
                    raise
                continue  # a dead engine: the health monitor replaces it, and its replacement starts unpaused
            if r.status_code != 200:
                raise RuntimeError(f"{url}/{endpoint} answered {r.status_code}: {r.text[:200]}")

    def _admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def _producer_main(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer by collect()
            self._producer_error = e
            self.buffer.close()

    async def _produce(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import httpx

        from miles.buffer.data_buffer import BufferClosed

        # Producers blocked by backpressure each hold a thread; admission needs one more.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(self.buffer.cfg.max_inflight_groups + 4, thread_name_prefix="buffer"))
        tasks: set[asyncio.Task] = set()
        async with httpx.AsyncClient(timeout=self.cfg.request_timeout_s, limits=_limits()) as client:
            while not self._stopping.is_set():
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
                await self._abort_all(client)
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _produce_one(self, client, prompt) -> None:
        group = await self._generate_group(client, prompt)
        await asyncio.to_thread(self.buffer.put, group)

    async def _abort_all(self, client) -> None:
        for url in self.engine_urls:
            try:
                await client.post(f"{url}/abort_request", json={"abort_all": True}, timeout=2,
                                  headers=self._admin_headers())
            except Exception:  # noqa: BLE001 - an unreachable engine has nothing in flight to abort
                pass

    def _sampling_params(self, prompt_index: int, k: int):
        from miles.rollout.generate import SamplingParams

        cfg = self.cfg
        # A seed per sample makes a run reproducible regardless of batching inside the engine.
        seed = hash((self.seed, prompt_index, k)) & 0x7FFFFFFF
        length = cfg.max_new_tokens
        if cfg.response_lengths == "long_tail":
            length = long_tail_length(cfg.max_new_tokens, seed)
        return SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, length, seed=seed,
                              ignore_eos=cfg.response_lengths == "long_tail")

    async def _generate_group(self, client, prompt):
        """All samples of one prompt, scored; a Group with `failure` set if generation gave up."""
        import httpx

        from miles.buffer.types import Group, Reason, SampleStatus
        from miles.rollout.generate import GenerationError

        with self._lock:
            url = self.router_url or self.engine_urls[self._next_engine % len(self.engine_urls)]
            self._next_engine += 1
        ids = self._encode(prompt.text)
        rids: list[str] = []
        if self.generate_fn is None:
            work = self._generate_samples(client, url, ids, prompt, rids)
        else:
            work = asyncio.gather(*(self._counted(self._generate_sample(client, url, ids, prompt, k, rids))
                                    for k in range(self.cfg.n_samples_per_prompt)))
        t0 = time.perf_counter()
        try:
            if self.cfg.group_timeout_s > 0:
                samples = await asyncio.wait_for(work, self.cfg.group_timeout_s)
            else:
                samples = await work
        except (asyncio.TimeoutError, TimeoutError, httpx.TimeoutException):
            await self._abort_rids(client, url, rids)
            return Group(samples=[], prompt_index=prompt.index, failure=Reason.TIMEOUT)
        except (httpx.HTTPError, GenerationError, OSError) as exc:
            why = str(exc)[:400]
            if why not in self._failures_seen:  # each distinct cause once, not once per group
                self._failures_seen.add(why)
                log.warning("a group of prompt %d failed and goes to buffer.on_failure: %s", prompt.index, why)
            await self._abort_rids(client, url, rids)
            if self.router_url:
                await self._wait_for_engines(client)
            return Group(samples=[], prompt_index=prompt.index, failure=Reason.ENGINE_FAILURE)
        if any(s.status is SampleStatus.ABORTED for s in samples):
            return Group(samples=[], prompt_index=prompt.index, failure=Reason.ABORTED)
        t_reward = time.perf_counter()
        for s in samples if self.generate_fn is None else ():
            s.reward = float(self.reward_fn(s.response_text, s.label))
        group = Group(samples=samples, prompt_index=prompt.index)
        self._stats.add(group, time.perf_counter() - t0, reward_s=time.perf_counter() - t_reward)
        return group

    async def _wait_for_engines(self, client) -> None:
        """Hold a failed group while the router has no engine to serve it (all being replaced), so its
        retry is not spent at once on the same failure."""
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            try:
                if (await client.get(f"{self.router_url}/health", timeout=5)).status_code == 200:
                    return
            except Exception:  # noqa: BLE001 - the router itself unreachable: keep waiting until the deadline
                pass
            await asyncio.sleep(0.5)

    async def _abort_rids(self, client, url: str, rids: list[str]) -> None:
        async def one(rid):
            try:
                await client.post(f"{url}/abort_request", json={"rid": rid}, timeout=2)
            except Exception:  # noqa: BLE001 - best effort: the engine may be the thing that failed
                pass

        # Short and concurrent: a hung engine must not hold the group's slot much past its timeout.
        await asyncio.gather(*(one(r) for r in rids))

    async def _generate_samples(self, client, url, prompt_ids, prompt, rids: list[str]):
        """The group's samples in one batched request (or one request each, with batch_requests off);
        with partial rollout, the aborted ones resume from their generated prefixes, again together."""
        import dataclasses

        from miles.buffer.types import Sample, SampleStatus
        from miles.rollout.generate import GenerationError, generate, generate_many

        n = self.cfg.n_samples_per_prompt
        params = [self._sampling_params(prompt.index, k) for k in range(n)]
        response: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        last: list = [None] * n
        todo, segment = list(range(n)), 0
        while todo:
            # The engine reports the version of a segment's last token; the version it held when the
            # request went out bounds the first token's from below, so staleness is never understated.
            known = self.buffer.weight_version
            seg_rids = [f"p{prompt.index}-{k}-{self._step}-{time.monotonic_ns()}-{segment}" for k in todo]
            rids.extend(seg_rids)
            seg_params = [dataclasses.replace(params[k], max_new_tokens=params[k].max_new_tokens - len(response[k]),
                                              seed=None if params[k].seed is None else params[k].seed + segment)
                          for k in todo]
            prompts = [prompt_ids + response[k] for k in todo]
            routed = self.cfg.return_routed_experts
            if self.cfg.batch_requests:
                try:
                    outs = await generate_many(client, url, prompts, seg_params, rids=seg_rids, label=prompt.label,
                                               prompt_index=prompt.index, return_routed_experts=routed)
                except GenerationError as exc:
                    if " 422:" not in str(exc):
                        raise
                    raise GenerationError(f"{exc} (a server that takes one prompt per request, such as the Rust "
                                          "sglang-router, refuses batched requests: set "
                                          "rollout.batch_requests = false)") from None
            else:
                outs = await asyncio.gather(*(
                    generate(client, url, ids, sp, rid=rid, label=prompt.label, prompt_index=prompt.index,
                             return_routed_experts=routed) for ids, sp, rid in zip(prompts, seg_params, seg_rids)))
            resume = []
            for k, s in zip(todo, outs):
                response[k] += s.response_ids
                logprobs[k] += s.rollout_logprobs
                versions[k].append(min(known, s.oldest_weight_version))
                last[k] = s
                if (s.status is SampleStatus.ABORTED and self.cfg.partial_rollout and segment < self.cfg.max_resumes
                        and len(response[k]) < params[k].max_new_tokens and not self._stopping.is_set()):
                    resume.append(k)
                else:
                    self._samples_done += 1  # only the event loop's thread writes it
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
                                  routed_experts=s.routed_experts))
        return samples

    async def _generate_sample(self, client, url, prompt_ids, prompt, k: int, rids: list[str]):
        """One sample from the configured custom generate function."""
        params = self._sampling_params(prompt.index, k)
        rids.append(f"p{prompt.index}-{k}-{self._step}-{time.monotonic_ns()}")
        return await self.generate_fn(self._generate_context(client, url), prompt, params, rids[-1])

    def _take_stats(self, elapsed: float | None) -> dict[str, float]:
        stats, self._stats = self._stats, _SampleStats()
        return stats.metrics(elapsed)

    def _generate_context(self, client, url: str):
        from miles.rollout.agent import GenerateContext

        return GenerateContext(client, url, self.tokenizer, self._encode, self.reward_fn, self.cfg.agent,
                               self.cfg.return_routed_experts)

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out split."""
        from miles.rollout.generate import SamplingParams, generate

        params = SamplingParams(temperature=0.0, max_new_tokens=self.eval_cfg.max_new_tokens)
        jobs = []
        for i, p in enumerate(self.eval_prompts):
            url = self.router_url or self.engine_urls[i % len(self.engine_urls)]
            if self.generate_fn is not None:
                jobs.append(lambda c, url=url, p=p: self.generate_fn(self._generate_context(c, url), p, params,
                                                                     f"eval-{p.index}-{time.monotonic_ns()}"))
                continue
            ids = self._encode(p.text)
            jobs.append(lambda c, url=url, ids=ids, p=p: generate(c, url, ids, params, label=p.label,
                                                                  prompt_index=p.index))
        t0 = time.perf_counter()
        samples = run_coroutine(_run_all(jobs, self.cfg.request_timeout_s))
        if self.generate_fn is not None:
            correct = sum(s.reward > 0 for s in samples)
        else:
            correct = sum(self.reward_fn(s.response_text, s.label) > 0 for s in samples)
        return {"eval/accuracy": correct / len(samples), "eval/num_prompts": len(samples),
                "eval/time_s": time.perf_counter() - t0}

    def source_position(self) -> int:
        return self.source.position



def _limits():
    import httpx

    return httpx.Limits(max_connections=1024, max_keepalive_connections=256)


class _SampleStats:
    """Generation figures accumulated between two reports (thread-safe enough: one writer thread)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.samples = self.tokens = self.truncated = self.groups = self.zero_std = 0
        self.reward = 0.0
        self.reward_s = 0.0  # scoring runs on the event loop, so these seconds add to the rollout's wall time
        self.group_s: list[float] = []

    def add(self, group, seconds: float, reward_s: float = 0.0) -> None:
        self.groups += 1
        self.reward_s += reward_s
        self.zero_std += len(set(group.rewards)) == 1
        self.group_s.append(seconds)
        for s in group.samples:
            self.samples += 1
            self.tokens += len(s.response_ids)
            self.truncated += s.status.value == "truncated"
            self.reward += s.reward

    def metrics(self, elapsed: float | None) -> dict[str, float]:
        elapsed = elapsed if elapsed is not None else time.perf_counter() - self.t0
        n = max(self.samples, 1)
        out = {"rollout/samples": float(self.samples), "rollout/time_s": elapsed,
               "rollout/samples_per_s": self.samples / max(elapsed, 1e-9),
               "rollout/tokens_per_s": self.tokens / max(elapsed, 1e-9), "perf/reward_s": self.reward_s}
        if self.samples:
            out.update({"rollout/reward_mean": self.reward / n, "rollout/response_len_mean": self.tokens / n,
                        "rollout/truncated_frac": self.truncated / n,
                        "rollout/zero_std_group_frac": self.zero_std / max(self.groups, 1),
                        "rollout/group_time_max_s": max(self.group_s)})
        return out
