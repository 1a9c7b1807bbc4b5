"""`miles bench algorithms`: every RL algorithm trains the arithmetic example without diverging.

One short SFT warm start of the tiny Qwen3 preset, then a short RL run per algorithm from that same
checkpoint, one after another: eval accuracy (greedy, held-out) before and after, the last steps'
mean reward, and whether the run diverged (a NaN/inf loss, or accuracy falling well below the warm
start). The baseline each algorithm is compared with is the SFT model it starts from.
Last line: one JSON object with every run's figures.

    miles bench algorithms [--rl-steps 30] [--sft-steps 400] [--only grpo,ppo]

The warm start and one RL run of the example (`warm_start`, `rl_run`) are shared with the other
benchmarks that train the arithmetic example from an SFT checkpoint (`miles bench staleness`).
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
    from miles.orchestration.ray_cluster import ensure_ray
    from miles.run_sections import RayConfig

    ensure_ray(RayConfig(num_cpus=2))


def mean_of(records: list[dict], key: str) -> float:
    """Mean of `key` over the records that have it (NaN if none does)."""
    xs = [r[key] for r in records if key in r]
    return sum(xs) / len(xs) if xs else math.nan


def warm_start(out: Path, sft_model: str = "", preset: str = "tiny-qwen3", sft_steps: int | None = None) -> Path:
    """The SFT checkpoint the RL runs start from: `sft_model` as given, else one trained now with the
    example's sft.toml into out/sft-model (sft_steps caps its steps; None keeps the file's)."""
    if sft_model:
        return Path(sft_model)
    # Imported here, not at the top: torch reads OMP_NUM_THREADS when first imported, and main sets it.
    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.models.presets import build_tiny_model
    from miles.orchestration.driver import run_sft

    base = build_tiny_model(preset, out / "base")
    over = {"model.path": str(base), "sft.out": str(out / "sft-model"), "metrics.progress": "plain"}
    if sft_steps is not None:
        over["sft.steps"] = str(sft_steps)
    run_sft(load_config(RunConfig, EXAMPLE / "sft.toml", over))
    return out / "sft-model"


def rl_run(sft_model: Path, out: Path, name: str, overrides: dict[str, str]) -> tuple[dict, list[dict]]:
    """One RL run of the example (grpo.toml, no intermediate evals or checkpoints, then `overrides`)
    from `sft_model`: the run's summary and its per-step metric records (step 0, the eval before, left out)."""
    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.orchestration.driver import run_train

    over = {"model.path": str(sft_model), "run.output_dir": str(out / "runs"), "run.name": name,
            "eval.every_steps": "0", "loop.save_every": "0", "metrics.progress": "plain", **overrides}
    summary = run_train(load_config(RunConfig, EXAMPLE / "grpo.toml", over))
    recs = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in recs if r["step"] > 0]


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

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from miles.orchestration.ray_cluster import ensure_ray
    from miles.run_sections import RayConfig

    out = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-algos-"))
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        sys.exit(f"miles bench algorithms: unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")

    ensure_ray(RayConfig(num_cpus=2))  # a cluster of its own, whatever else runs here
    t0 = time.perf_counter()
    sft_model = warm_start(out, args.sft_model, "tiny-qwen3", args.sft_steps)
    results = {}
    for name in names:
        algo = name.split("+")[0]
        over = {"loop.num_steps": str(args.rl_steps), "eval.num_prompts": str(args.eval_prompts),
                "rollout.prompts_per_step": str(args.prompts_per_step),
                "trainer.algorithm.name": algo, "trainer.algorithm.clip_eps_low": "none",
                "trainer.algorithm.clip_eps_high": "none", **VARIANTS[name]}
        t = time.perf_counter()
        summary, steps = rl_run(sft_model, out, name, over)
        tail = steps[-5:]
        losses = [r["train/loss"] for r in steps if "train/loss" in r]
        before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
        diverged = any(not math.isfinite(x) for x in losses) or after < before - 0.1
        results[name] = {"eval_accuracy_before": before, "eval_accuracy_after": after,
                         "reward_last5": sum(r["rollout/reward_mean"] for r in tail) / max(len(tail), 1),
                         "reward_first5": sum(r["rollout/reward_mean"] for r in steps[:5]) / max(len(steps[:5]), 1),
                         "diverged": diverged, "wall_s": time.perf_counter() - t}
        print(f"[bench algorithms] {name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    ray.shutdown()
    print(json.dumps({"rl_steps": args.rl_steps, "sft_steps": args.sft_steps, "results": results,
                      "all_stable": not any(r["diverged"] for r in results.values()),
                      "wall_s": time.perf_counter() - t0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
