"""Prefix-cache hit rate of multi-turn calculator rollouts, as the engine's /metrics reports it.

Starts a built-in engine on `--model`, plays `--prompts` × `--samples` episodes concurrently (the
shape of one GRPO step), and prints one JSON line: prompt tokens, tokens served from the prefix
cache and their ratio, as the engine's /metrics counts them, and the same ratio split into first
turns and later turns from each response's `cached_tokens`. Every turn after the first resends the
whole history as token ids, so a turn's prompt is the previous turn's prompt plus its output plus
the tool turn; the samples of one prompt share the first turn's prompt. Only the tool turn and the
turn-end token before it are new to the cache on a later turn (the end token is sampled last, so
its KV was never computed).

    python examples/tool_calc/cache_report.py --model runs/tool_calc/grpo/checkpoints/step_12
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections import defaultdict


def scrape(text: str, name: str) -> float:
    m = re.search(rf"^miles_engine_{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    if m is None:
        raise RuntimeError(f"the engine's /metrics has no miles_engine_{name}")
    return float(m.group(1))


async def play(url: str, model: str, prompts: int, samples: int, digits: int, fixed_width: bool, seed: int,
               per_turn: dict):
    import httpx

    from miles.models.loading import load_tokenizer
    from miles.data.chat import ChatFormat
    from miles.rollout.agent.episode import run_episode
    from miles.rollout.config import AgentConfig
    from miles.data.prompts import PromptSource, TaskConfig
    from miles.rollout.environments.tool_calc import CalculatorEnv
    from miles.rollout.generate import SamplingParams

    tok = load_tokenizer(model)
    fmt, cfg = ChatFormat(tok), AgentConfig(max_turns=3, max_response_tokens=96)
    tasks = PromptSource(TaskConfig(name="arithmetic", digits=digits, fixed_width=fixed_width), "eval",
                         seed).take(prompts)

    async def record(response):
        # Each /generate answer says how many of its prompt tokens came from the cache.
        if response.request.url.path.endswith("/generate") and response.status_code == 200:
            await response.aread()
            meta = response.json()["meta_info"]
            turn = int(re.search(r"-t(\d+)", json.loads(response.request.content)["rid"]).group(1))
            counts = per_turn["first" if turn == 0 else "later"]
            counts[0] += meta["prompt_tokens"]
            counts[1] += meta["cached_tokens"]

    async with httpx.AsyncClient(timeout=600, event_hooks={"response": [record]}) as client:
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
    p.add_argument("--no-fixed-width", dest="fixed_width", action="store_false",
                   help="unpadded problems (7+38=) instead of the fixed-width layout (07+38=)")
    p.add_argument("--block-size", type=int, default=8, help="the engine's prefix-cache block size")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import httpx

    from miles.engine.process import EngineProcess

    per_turn: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # prompt tokens, cached tokens
    with EngineProcess(a.model, extra_args=["--prefix-block-size", str(a.block_size)]) as engine:
        episodes = asyncio.run(play(engine.url, a.model, a.prompts, a.samples, a.digits, a.fixed_width, a.seed,
                                    per_turn))
        metrics = httpx.get(f"{engine.url}/metrics", timeout=30).text
    prompt_tokens, cached = scrape(metrics, "prompt_tokens_total"), scrape(metrics, "cached_tokens_total")
    turns = sum(len(s.weight_versions) for s in episodes)
    report = {"episodes": len(episodes), "model_turns": turns, "turns_per_episode": turns / len(episodes),
              "tool_use": sum(len(s.weight_versions) > 1 for s in episodes) / len(episodes),
              "accuracy": sum(s.reward > 0 for s in episodes) / len(episodes), "block_size": a.block_size,
              "prompt_tokens": prompt_tokens, "cached_tokens": cached,
              "prefix_cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0}
    for name, (n, c) in sorted(per_turn.items()):
        report[f"hit_rate_{name}_turns"] = c / n if n else 0.0
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
