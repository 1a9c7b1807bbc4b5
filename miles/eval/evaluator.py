"""Evaluator: the held-out greedy accuracy (`eval/accuracy`) and every configured eval set, generated
through the same path as training (the built-in single-turn one, or the configured generate function,
which scores its own samples) on the engines the run already has.

Per eval set it draws the set's prompts once, then at each evaluation decodes each prompt greedily
(`eval/<set>/accuracy`) and samples it n times with seeded requests (`eval/<set>/pass@k`, `avg@k`,
`maj@k`; formulas in metrics.py). A sample is correct as the reward says (metrics.is_correct: the
eval config's correct_threshold, else the reward's verdict, else score > 0). Non-goals: starting engines (standalone.py does that for
`miles eval`), training-time statistics (rollout/stats.py).
"""

from __future__ import annotations

import dataclasses
import time
import zlib

import httpx

from miles.data.chat import encode_prompt
from miles.engine_api.aio import run_jobs
from miles.eval.config import EvalConfig, EvalSetConfig
from miles.eval.metrics import accuracy, get_answer_fn, is_correct, prompt_metrics
from miles.data.prompts import Prompt, PromptSource, TaskConfig
from miles.rewards.contract import Scored
from miles.rewards.runner import RewardRunner
from miles.rollout.generate import SamplingParams, generate
from miles.rollout.group import GroupGenerator


_EVAL_ATTEMPTS = 3  # an eval request whose router dies under it this many times fails the evaluation


class Evaluator:
    def __init__(self, cfg: EvalConfig, groups: GroupGenerator, seed: int = 0):
        self.cfg, self.groups, self.seed = cfg, groups, seed
        self.prompts = PromptSource(groups.cfg.task, "eval", seed).take(cfg.num_prompts)
        self.set_prompts = {s.name: PromptSource(s.task or groups.cfg.task, s.split, seed).take(s.num_prompts)
                            for s in cfg.sets}
        # Loaded once: a reward runner holds threads (and a process pool with reward_config.num_workers).
        self.set_rewards = {s.name: RewardRunner(s.reward) for s in cfg.sets if s.reward}
        # The run's reward, on a runner of its own: eval calls stay out of the training steps' reward/* metrics.
        self.rewards = RewardRunner(groups.cfg.reward, groups.cfg.reward_config) if groups.rewards else None

    def evaluate(self) -> dict[str, float]:
        """eval/accuracy (greedy, the task's eval split) and each eval set's eval/<set>/... figures."""
        params = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.max_new_tokens)
        t0 = time.perf_counter()
        samples = self._run(self.prompts, [params], self.groups.cfg.task, None)
        scored = self._scored(samples, None)
        out = {"eval/accuracy": accuracy(self._correct(scored, self.cfg.correct_threshold)),
               "eval/num_prompts": len(samples),
               "eval/time_s": time.perf_counter() - t0}
        for s in self.cfg.sets:
            out.update({f"eval/{s.name}/{k}": v for k, v in self.evaluate_set(s).items()})
        return out

    def evaluate_set(self, s: EvalSetConfig) -> dict[str, float]:
        """One set's figures, keyed without the eval/<set>/ prefix."""
        prompts, task = self.set_prompts[s.name], s.task or self.groups.cfg.task
        rewards = self.set_rewards.get(s.name)
        t0 = time.perf_counter()
        out: dict[str, float] = {"num_prompts": len(prompts)}
        if s.greedy:
            greedy = SamplingParams(temperature=0.0, max_new_tokens=s.max_new_tokens)
            scored = self._scored(self._run(prompts, [greedy], task, rewards), rewards)
            out["accuracy"] = accuracy(self._correct(scored, s.correct_threshold))
        if s.n >= 1:
            # Seeds fixed by run seed, set name (crc32: str hashes are salted per process) and sample
            # number; _run adds the prompt.
            base = self.seed * 1_000_003 + zlib.crc32(s.name.encode())
            params = [SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                     max_new_tokens=s.max_new_tokens, seed=(base + j) & 0x7FFFFFFF)
                      for j in range(s.n)]
            samples = self._run(prompts, params, task, rewards)
            flat = self._scored(samples, rewards)
            flat_correct = self._correct(flat, s.correct_threshold)
            scores = [[x.score for x in flat[i * s.n:(i + 1) * s.n]] for i in range(len(prompts))]
            correct = [flat_correct[i * s.n:(i + 1) * s.n] for i in range(len(prompts))]
            answers = None
            if "maj" in s.metrics:
                answer_fn = get_answer_fn(s.answer)
                texts = [x.response_text for x in samples]
                answers = [[answer_fn(t) for t in texts[i * s.n:(i + 1) * s.n]] for i in range(len(prompts))]
            out.update(prompt_metrics(scores, correct, answers, s.ks, s.metrics))
        out["time_s"] = time.perf_counter() - t0
        return out

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], task: TaskConfig,
             rewards: RewardRunner | None) -> list:
        """Every prompt once per entry of `params` (prompt-major order), all requests concurrently.

        A request's seed is made per prompt so that a prompt's samples differ from each other and from
        another prompt's, yet are the same at every evaluation. A plugged-in generate function scores
        with `rewards` (the set's own reward) when one is given."""
        g, admin = self.groups, self.groups.admin
        jobs = []
        for i, p in enumerate(prompts):
            url = admin.router_url or admin.urls[i % len(admin.urls)]
            ids = None if g.generate_fn is not None else self._encode(p, task)
            for j, sp in enumerate(params):
                if sp.seed is not None:
                    sp = dataclasses.replace(sp, seed=(sp.seed + 7919 * p.index) & 0x7FFFFFFF)
                if g.generate_fn is not None:
                    jobs.append(lambda c, url=url, p=p, sp=sp, j=j: g.generate_fn(
                        self._context(c, url, rewards), p, sp, f"eval-{p.index}-{j}-{time.monotonic_ns()}"))
                elif g.merges(p):
                    # Every request of the evaluation in one POST per engine (rollout/merge.py).
                    jobs.append(lambda c, url=url, ids=ids, p=p, sp=sp, j=j: _first(g.merger.generate(
                        c, url, [ids], [sp], [f"eval-{p.index}-{j}-{time.monotonic_ns()}"], p.label, p.index)))
                else:
                    jobs.append(lambda c, url=url, ids=ids, p=p, sp=sp: generate(
                        c, url, ids, sp, label=p.label, prompt_index=p.index, images=p.images, vision=g.vision))
        return run_jobs([self._across_router_restarts(j) for j in jobs], g.cfg.request_timeout_s)

    def _across_router_restarts(self, job):
        """The job, made again when the router it went through stopped answering (a router process
        being restarted, router.own_process), once the router answers again. Eval requests are greedy
        or seeded, so a repeat asks for exactly the same thing."""
        admin = self.groups.admin

        async def run(client):
            for attempt in range(_EVAL_ATTEMPTS):
                try:
                    return await job(client)
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                    if admin.router_url is None or attempt == _EVAL_ATTEMPTS - 1:
                        raise
                    await admin.wait_for_router(client, self.groups.cfg.request_timeout_s, self.groups.stopping)

        return run

    def _context(self, client, url: str, rewards: RewardRunner | None):
        ctx = self.groups.context(client, url)
        rewards = rewards or self.rewards
        return ctx if rewards is None else dataclasses.replace(ctx, reward_fn=rewards.score_text)

    def _encode(self, p: Prompt, task: TaskConfig) -> list[int]:
        """The prompt's ids under its set's task settings (messages through the chat template, image
        placeholders expanded by a vision-language model's processor)."""
        return encode_prompt(self.groups.tokenizer, task, p.text, p.messages, p.images, self.groups.vision)

    def _scored(self, samples: list, rewards: RewardRunner | None) -> list[Scored]:
        """Each sample's score and the reward's verdict: a plugged-in generate function's own reward
        (unless it leaves scoring to the run, `scores_itself = False`), else the reward's (the set's own,
        or rollout.reward)."""
        if self.groups.generate_fn is not None and getattr(self.groups.generate_fn, "scores_itself", True):
            return [Scored(float(s.reward), s.correct) for s in samples]
        runner = rewards or self.rewards or self.groups.rewards
        return [runner.judge_text(s.response_text, s.label) for s in samples]

    @staticmethod
    def _correct(scored: list[Scored], threshold: float | None) -> list[bool]:
        return [is_correct(x.score, x.correct, threshold) for x in scored]


async def _first(samples):
    """The one Sample of a merged request for one prompt."""
    return (await samples)[0]
