"""`miles bench algorithms`: every RL algorithm trains the arithmetic example without diverging.

One short SFT warm start of the tiny Qwen3 preset, then a short RL run per algorithm from that same
checkpoint, one after another: eval accuracy (greedy, held-out) before and after, the last steps'
mean reward, and whether the run diverged (a NaN/inf loss, or accuracy falling well below the warm
start). The baseline each algorithm is compared with is the SFT model it starts from.
Last line: one JSON object with every run's figures.

    miles bench algorithms [--rl-steps 30] [--sft-steps 400] [--only grpo,ppo]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "arithmetic"

VARIANTS = {
    "grpo": {},
    "dr_grpo": {},
    "dapo": {},
    "gspo": {},
    "reinforce_pp": {},
    "reinforce_pp_baseline": {},
    "rloo": {},
    "ppo": {"trainer.algorithm.critic_lr": "1e-3"},
    # The shared extras on top of GRPO: KL to the reference as a loss (k3), entropy bonus, dual-clip.
    "grpo+kl+entropy+dualclip": {"trainer.algorithm.kl_coef": "0.01", "trainer.algorithm.kl_estimator": "k3",
                                 "trainer.algorithm.entropy_coef": "0.001", "trainer.algorithm.dual_clip_c": "3.0"},
    # KL as a reward penalty (k1 summed to the end), REINFORCE++ style.
    "reinforce_pp+kl_reward": {"trainer.algorithm.kl_coef": "0.01", "trainer.algorithm.kl_mode": "reward"},
}


def start_ray() -> None:
    """A Ray cluster of the benchmark's own (2 CPUs), whatever else runs on this machine."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from miles.orchestration.ray_cluster import RayConfig, ensure_ray

    ensure_ray(RayConfig(num_cpus=2))


def warm_start(out: Path, sft_steps: int) -> Path:
    """The arithmetic example's SFT warm start (examples/arithmetic/sft.toml) of the tiny Qwen3 preset,
    at most `sft_steps` steps, saved under `out`."""
    from miles.config import load_config
    from miles.config.run import RunConfig
    from miles.models.presets import build_tiny_model
    from miles.orchestration.driver import run_sft

    sft_model = out / "sft-model"
    base = build_tiny_model("tiny-qwen3", out / "base")
    run_sft(load_config(RunConfig, EXAMPLE / "sft.toml", {"model.path": str(base), "sft.out": str(sft_model),
                                                          "sft.steps": str(sft_steps)}))
    return sft_model


def rl_run(sft_model: Path, runs_dir: Path, name: str, steps: int, overrides: dict[str, str]) -> dict:
    """One RL run of the arithmetic example (examples/arithmetic/grpo.toml with `overrides`) for `steps`
    steps from the warm start `sft_model`, evaluated (greedy, held-out) only before and after: its
    accuracies, every step's metrics record and its wall time."""
    from miles.config import load_config
    from miles.config.run import RunConfig
    from miles.orchestration.driver import run_train

    over = {"model.path": str(sft_model), "run.output_dir": str(runs_dir), "run.name": name,
            "loop.num_steps": str(steps), "eval.every_steps": "0", "loop.save_every": "0", **overrides}
    t = time.perf_counter()
    summary = run_train(load_config(RunConfig, EXAMPLE / "grpo.toml", over))
    recs = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {"eval_accuracy_before": summary["eval_accuracy_before"],
            "eval_accuracy_after": summary["eval_accuracy_after"],
            "steps": [r for r in recs if r["step"] > 0], "wall_s": time.perf_counter() - t}


def mean_of(records: list[dict], key: str) -> float:
    """Mean of `key` over the records that have it (NaN if none does)."""
    xs = [r[key] for r in records if key in r]
    return sum(xs) / len(xs) if xs else math.nan


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench algorithms", description=__doc__.split("\n\n")[0])
    p.add_argument("--rl-steps", type=int, default=30)
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--out", default="", help="working folder (default: a temporary one)")
    p.add_argument("--sft-model", default="", help="start from this warm-started checkpoint (skips the SFT)")
    args = p.parse_args(argv)

    out = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-algos-"))
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        sys.exit(f"miles bench algorithms: unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    start_ray()
    import ray

    t0 = time.perf_counter()
    sft_model = Path(args.sft_model) if args.sft_model else warm_start(out, args.sft_steps)
    results = {}
    for name in names:
        over = {"eval.num_prompts": str(args.eval_prompts), "rollout.prompts_per_step": str(args.prompts_per_step),
                "trainer.algorithm.name": name.split("+")[0], "trainer.algorithm.clip_eps_low": "none",
                "trainer.algorithm.clip_eps_high": "none", **VARIANTS[name]}
        r = rl_run(sft_model, out / "runs", name, args.rl_steps, over)
        steps = r["steps"]
        losses = [s["train/loss"] for s in steps if "train/loss" in s]
        before, after = r["eval_accuracy_before"], r["eval_accuracy_after"]
        diverged = any(not math.isfinite(x) for x in losses) or after < before - 0.1
        results[name] = {"eval_accuracy_before": before, "eval_accuracy_after": after,
                         "reward_last5": mean_of(steps[-5:], "rollout/reward_mean"),
                         "reward_first5": mean_of(steps[:5], "rollout/reward_mean"),
                         "diverged": diverged, "wall_s": r["wall_s"]}
        print(f"[bench algorithms] {name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    ray.shutdown()
    print(json.dumps({"rl_steps": args.rl_steps, "sft_steps": args.sft_steps, "results": results,
                      "all_stable": not any(r["diverged"] for r in results.values()),
                      "wall_s": time.perf_counter() - t0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
