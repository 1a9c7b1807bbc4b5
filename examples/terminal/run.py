"""Terminal tasks end to end: a model's shell commands run in the sandbox and a verifier scores them.

One command builds a tiny Qwen3, then for each small task (create or inspect files) plays an
episode against a built-in engine: every model turn is run as a shell command in a fresh sandbox,
its output comes back as the tool turn, and the task's verifier decides the reward. It does this
three times and prints one JSON line with the rewards:
  - `reference`: the tasks' reference commands played through the same environment (the verifier
    accepts a correct solution),
  - `base`: the untrained model (random commands; the sandbox contains whatever they do),
  - `warm_start`: the model after a short supervised warm start on the reference episodes.

    .venv/bin/python examples/terminal/run.py [--out runs/terminal]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from pathlib import Path


def _warm_start_module():
    # The SFT loop is shared with the calculator example.
    path = Path(__file__).resolve().parents[1] / "tool_calc" / "warm_start.py"
    spec = importlib.util.spec_from_file_location("tool_calc_warm_start", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def reference_rewards() -> dict[str, float]:
    from miles.data.prompts import Prompt
    from miles.rollout.environments.terminal import DONE, TASKS, TerminalEnv

    out = {}
    for t in TASKS:
        env = TerminalEnv()
        env.reset(Prompt(index=0, text=t.instruction, label=t.name))
        env.step(t.solution)
        out[t.name] = env.step(DONE).reward
        env.close()
    return out


def demonstrations(tokenizer) -> list[tuple[list[int], list[int]]]:
    """Each task solved: the reference command, the sandbox's real reply to it, then `done`."""
    from miles.data.chat import ChatFormat
    from miles.data.prompts import Prompt
    from miles.rollout.environments.terminal import DONE, TASKS, TerminalEnv

    fmt = ChatFormat(tokenizer)
    data = []
    for t in TASKS:
        env = TerminalEnv()
        ids = fmt.prompt_ids(env.reset(Prompt(index=0, text=t.instruction, label=t.name)))
        mask = [0] * len(ids)
        reply = env.step(t.solution).observation
        env.close()
        for role, text in (("assistant", t.solution), ("tool", reply), ("assistant", DONE)):
            if role == "assistant":
                turn = tokenizer(text, add_special_tokens=False).input_ids + [fmt.end_id]
                ids, mask = ids + turn, mask + [1] * len(turn)
            else:
                obs = fmt.observation_ids(text, closed=True)
                ids, mask = ids + obs, mask + [0] * len(obs)
        data.append((ids, mask))
    return data


async def _episodes(url: str, model_dir: str, samples: int):
    import httpx

    from miles.models.loading import load_tokenizer
    from miles.rollout.agent.episode import run_episode
    from miles.rollout.config import AgentConfig
    from miles.data.prompts import Prompt
    from miles.rollout.environments.terminal import TASKS, TerminalEnv
    from miles.rollout.generate import SamplingParams

    tok = load_tokenizer(model_dir)
    cfg = AgentConfig(environment="terminal", max_turns=4, max_response_tokens=256, episode_timeout_s=120)
    # Greedy first, then sampled tries: a task counts as solved per episode.
    params = [SamplingParams(temperature=0.0, max_new_tokens=48)] + \
             [SamplingParams(temperature=1.0, max_new_tokens=48, seed=k) for k in range(1, samples)]
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(
            run_episode(client, url, tok, TerminalEnv(), Prompt(index=i, text=t.instruction, label=t.name), p, cfg,
                        rid=f"terminal-{t.name}-{k}")
            for i, t in enumerate(TASKS) for k, p in enumerate(params)))


def model_rewards(model_dir: str, samples: int) -> dict[str, float]:
    from miles.engine.process import EngineProcess

    with EngineProcess(model_dir) as engine:
        episodes = asyncio.run(_episodes(engine.url, model_dir, samples))
    out: dict[str, list[float]] = {}
    for s in episodes:
        out.setdefault(s.label, []).append(s.reward)
    return {name: sum(r) / len(r) for name, r in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/terminal", help="where the models are written")
    p.add_argument("--steps", type=int, default=150, help="warm-start steps")
    p.add_argument("--samples", type=int, default=4, help="episodes per task and model (the first greedy)")
    a = p.parse_args(argv)

    import torch

    from miles.models.loading import load_model, load_tokenizer
    from miles.models.presets import build_tiny_model
    from miles.rollout.environments.sandbox import check_available

    check_available()  # refuse up front, before building anything, when commands could not be confined
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = Path(a.out)
    base = str(build_tiny_model("tiny-qwen3", out / "base"))
    report = {"reference": reference_rewards()}
    report["base"] = model_rewards(base, a.samples)
    tok = load_tokenizer(base)
    model = load_model(base).train()
    ws = _warm_start_module()
    ws.train_on_episodes(model, demonstrations(tok), a.steps, 16, 3e-3, tok.pad_token_id, tag="terminal warm start")
    sft = out / "sft-model"
    model.save_pretrained(sft)
    tok.save_pretrained(sft)
    report["warm_start"] = model_rewards(str(sft), a.samples)
    report["mean"] = {k: sum(v.values()) / len(v) for k, v in report.items()}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
