"""Held-out evaluation: greedy accuracy on the eval split, with the same generate path as training
(the built-in single-turn one, or the configured generate function, which scores its own samples).

Non-goals: pass@k and eval sets beyond the task's own split (miles eval); training-time statistics.
"""

from __future__ import annotations

import time

from miles.rollout.config import EvalConfig
from miles.rollout.generate import SamplingParams, generate
from miles.rollout.group import GroupGenerator
from miles.rollout.http import run_jobs


class Evaluator:
    def __init__(self, cfg: EvalConfig, prompts: list, groups: GroupGenerator):
        self.cfg, self.prompts, self.groups = cfg, prompts, groups

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out split."""
        g, admin = self.groups, self.groups.admin
        params = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.max_new_tokens)
        jobs = []
        for i, p in enumerate(self.prompts):
            url = admin.router_url or admin.urls[i % len(admin.urls)]
            if g.generate_fn is not None:
                jobs.append(lambda c, url=url, p=p: g.generate_fn(g.context(c, url), p, params,
                                                                  f"eval-{p.index}-{time.monotonic_ns()}"))
                continue
            ids = g.encode(p.text)
            jobs.append(lambda c, url=url, ids=ids, p=p: generate(c, url, ids, params, label=p.label,
                                                                  prompt_index=p.index))
        t0 = time.perf_counter()
        samples = run_jobs(jobs, g.cfg.request_timeout_s)
        if g.generate_fn is not None:
            correct = sum(s.reward > 0 for s in samples)
        else:
            correct = sum(g.reward_fn(s.response_text, s.label) > 0 for s in samples)
        return {"eval/accuracy": correct / len(samples), "eval/num_prompts": len(samples),
                "eval/time_s": time.perf_counter() - t0}
