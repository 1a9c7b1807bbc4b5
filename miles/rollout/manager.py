"""RolloutManager: owns the prompt source, talks to the engines, scores samples, returns groups.

It never imports the trainer or the orchestrator; the driver calls `generate_groups` and
`evaluate`. Requests for the n samples of one prompt go to the same engine, so a prefix cache
there can share the prompt. Non-goals here: the router and health monitoring (separate parts).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from miles.rollout.data_source import TaskConfig


@dataclass
class RolloutConfig:
    num_engines: int = 1
    """Built-in engine processes to start."""
    engine_dtype: str = "float32"
    """Engine weights/compute dtype: float32 or bfloat16."""
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
    reward: str = "exact_match"
    """Reward function by name or module:function."""
    request_timeout_s: float = 300.0
    """Give up on one /generate after this many seconds."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Where prompts come from."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.num_engines < 1:
            raise ConfigError("rollout.num_engines must be >= 1")
        if self.n_samples_per_prompt < 1 or self.prompts_per_step < 1:
            raise ConfigError("rollout.n_samples_per_prompt and rollout.prompts_per_step must be >= 1")
        if self.temperature <= 0:
            raise ConfigError("rollout.temperature must be > 0 for RL sampling (greedy rollouts give no "
                              "variance within a group)")
        if not 0 < self.top_p <= 1:
            raise ConfigError("rollout.top_p must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ConfigError("rollout.max_new_tokens must be >= 1")
        if self.engine_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("rollout.engine_dtype must be float32, bfloat16 or float16")
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


async def _run_all(jobs, timeout_s: float):
    # Kept outside the class: an `async def` method would make Ray run the actor as an async actor.
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        return await asyncio.gather(*(job(client) for job in jobs))


class RolloutManager:
    def __init__(self, cfg: RolloutConfig, eval_cfg: EvalConfig, model_path: str, engine_urls: list[str],
                 seed: int = 0):
        from miles.models.loading import load_tokenizer
        from miles.rollout.data_source import PromptSource
        from miles.rollout.reward import get_reward_fn

        self.cfg, self.eval_cfg, self.seed = cfg, eval_cfg, seed
        self.engine_urls = list(engine_urls)
        self.tokenizer = load_tokenizer(model_path)
        self.reward_fn = get_reward_fn(cfg.reward)
        self.source = PromptSource(cfg.task, "train", seed)
        self.eval_prompts = PromptSource(cfg.task, "eval", seed).take(eval_cfg.num_prompts)
        self._next_engine = 0
        self._step = 0

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
                    c, url, ids, params, rid=f"s{self._step}-p{p.index}-{k}", label=p.label, prompt_index=p.index))
        samples = asyncio.run(_run_all(jobs, self.cfg.request_timeout_s))
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

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out split."""
        from miles.rollout.generate import SamplingParams, generate

        params = SamplingParams(temperature=0.0, max_new_tokens=self.eval_cfg.max_new_tokens)
        jobs = []
        for i, p in enumerate(self.eval_prompts):
            url = self.engine_urls[i % len(self.engine_urls)]
            ids = self._encode(p.text)
            jobs.append(lambda c, url=url, ids=ids, p=p: generate(c, url, ids, params, label=p.label,
                                                                  prompt_index=p.index))
        t0 = time.perf_counter()
        samples = asyncio.run(_run_all(jobs, self.cfg.request_timeout_s))
        correct = sum(self.reward_fn(s.response_text, s.label) > 0 for s in samples)
        return {"eval/accuracy": correct / len(samples), "eval/num_prompts": len(samples),
                "eval/time_s": time.perf_counter() - t0}

    def source_position(self) -> int:
        return self.source.position
