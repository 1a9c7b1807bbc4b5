"""Prefix-cache hit rate of multi-turn calculator rollouts, as the engine's /metrics reports it.

Starts a built-in engine on `--model`, plays `--prompts` × `--samples` episodes concurrently (the
shape of one GRPO step), and prints one JSON line: prompt tokens, tokens served from the prefix
cache and their ratio. Every turn after the first resends the whole history as token ids, so a
turn's prompt is the previous turn's prompt plus its output plus the tool turn; the samples of one
prompt share the first turn's prompt.

    python examples/tool_calc/cache_report.py --model runs/tool_calc/grpo/checkpoints/step_16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys


def scrape(text: str, name: str) -> float:
    m = re.search(rf"^miles_engine_{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    if m is None:
        raise RuntimeError(f"the engine's /metrics has no miles_engine_{name}")
    return float(m.group(1))


async def play(url: str, model: str, prompts: int, samples: int, digits: int, seed: int):
    import httpx

    from miles.models.loading import load_tokenizer
    from miles.rollout.agent import AgentConfig, ChatFormat, run_episode
    from miles.rollout.data_source import PromptSource, TaskConfig
    from miles.rollout.environments.tool_calc import CalculatorEnv
    from miles.rollout.generate import SamplingParams

    tok = load_tokenizer(model)
    fmt, cfg = ChatFormat(tok), AgentConfig(max_turns=3, max_response_tokens=96)
    tasks = PromptSource(TaskConfig(name="arithmetic", digits=digits), "eval", seed).take(prompts)
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(
            run_episode(client, url, tok, CalculatorEnv(), t, SamplingParams(1.0, max_new_tokens=16, seed=seed + 97 * k),
                        cfg, rid=f"cache-{t.index}-{k}", fmt=fmt)
            for t in tasks for k in range(samples)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import httpx

    from miles.rollout.engine.process import EngineProcess

    with EngineProcess(a.model) as engine:
        episodes = asyncio.run(play(engine.url, a.model, a.prompts, a.samples, a.digits, a.seed))
        metrics = httpx.get(f"{engine.url}/metrics", timeout=30).text
    prompt_tokens, cached = scrape(metrics, "prompt_tokens_total"), scrape(metrics, "cached_tokens_total")
    turns = sum(len(s.weight_versions) for s in episodes)
    report = {"episodes": len(episodes), "model_turns": turns, "turns_per_episode": turns / len(episodes),
              "accuracy": sum(s.reward > 0 for s in episodes) / len(episodes),
              "prompt_tokens": prompt_tokens, "cached_tokens": cached,
              "prefix_cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
