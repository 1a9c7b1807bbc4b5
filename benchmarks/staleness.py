"""`miles bench staleness`: how much eval accuracy the off-policy objectives keep as fully_async groups
grow staler, against the sync schedule at equal trained samples.

One SFT warm start of the arithmetic example (or --sft-model), then, from that same checkpoint:
  sync    GRPO with the sync schedule for --steps steps (staleness 0 by construction);
  cells   fully_async at each `buffer.max_staleness` s in --staleness, with each objective in --only:
            grpo_tis       GRPO with truncated importance sampling (`tis_mode = "truncate"`)
            decoupled_ppo  decoupled PPO as shipped (`trainer.algorithm.name = "decoupled_ppo"`): per-token
                           weights and the KL penalty toward the behaviour policy (`behav_kl_coef = 1`)
            decoupled_ppo_areal  AReaL's objective: the same without the penalty (`behav_kl_coef = 0`)
          and, with --only, AReaL's objective with options on: decoupled_ppo_seq (`sequence_weight`),
          decoupled_ppo_m2 (`m2_threshold = 0.04`), decoupled_ppo_seq_m2 (both),
          decoupled_ppo_reweighted (`group_reweight`)
          each for as many steps as it takes to train the samples the sync run trained (or, with
          --match updates, for as many steps as sync made).
Eval: greedy exact-match accuracy on the example's held-out prompts after the last step.
With --minibatches k, every run, sync included, makes k optimizer updates per step
(`trainer.minibatches_per_step`), so the cells are compared with a sync run trained the same way.

Making the staleness happen. The bound only caps staleness; what a group actually lags by is how far
the rollout runs ahead of the trainer. Each cell lets it run s steps ahead and no further: s steps'
groups between the trainer and the prompt source, s − 1 steps' ready (`buffer.capacity`, at least 1)
and the rest in flight (`buffer.max_inflight_groups`, one step's from s = 2). When the engine is
faster than the trainer (here it is), groups queue and are trained s versions old, and none is
generated only to be dropped as too stale. The first s steps train what was generated while the
rollout got ahead (0, 1, …, s − 1 versions old), so a short run's mean stays below s. Each cell
reports the staleness it measured (the mean over every trained group) beside its bound.

Last line: one JSON object, {"sync_eval_accuracy", "cells": [{"max_staleness", "objective",
"eval_accuracy", "mean_staleness", ...}], "gap_points_decoupled_s4", "gap_points_s4": {objective: gap},
"minibatches", ...}; with several --seeds,
accuracies are the mean over seeds and each cell lists its per-seed figures.

    miles bench staleness [--sft-model DIR] [--steps 100] [--staleness 1,4,8] [--only grpo_tis,decoupled_ppo]
                          [--seeds 0] [--minibatches 1] [--match samples|updates] [--threads 1]
                          [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.algorithms import rl_run, warm_start

OBJECTIVES = {
    "grpo_tis": {"trainer.algorithm.name": "grpo", "trainer.algorithm.tis_mode": "truncate"},
    "decoupled_ppo": {"trainer.algorithm.name": "decoupled_ppo", "trainer.algorithm.tis_mode": "off"},
}
# AReaL's objective, without the KL penalty toward the behaviour policy that decoupled_ppo adds by default.
OBJECTIVES["decoupled_ppo_areal"] = {**OBJECTIVES["decoupled_ppo"], "trainer.algorithm.behav_kl_coef": "0"}
# AReaL's objective with one or two of decoupled_ppo's options on (algorithms/decoupled_ppo.py), each an
# objective of its own.
OBJECTIVES.update({
    "decoupled_ppo_seq": {**OBJECTIVES["decoupled_ppo_areal"], "trainer.algorithm.sequence_weight": "true"},
    "decoupled_ppo_m2": {**OBJECTIVES["decoupled_ppo_areal"], "trainer.algorithm.m2_threshold": "0.04"},
    "decoupled_ppo_reweighted": {**OBJECTIVES["decoupled_ppo_areal"], "trainer.algorithm.group_reweight": "true"},
})
OBJECTIVES["decoupled_ppo_seq_m2"] = {**OBJECTIVES["decoupled_ppo_seq"], "trainer.algorithm.m2_threshold": "0.04"}
DEFAULT_OBJECTIVES = ("grpo_tis", "decoupled_ppo", "decoupled_ppo_areal")


def run_ahead(max_staleness: int, prompts_per_step: int) -> dict[str, str]:
    """Buffer settings that let the rollout run `max_staleness` steps ahead of the trainer, no further:
    ready plus in-flight groups add up to that many steps' groups. More would be generated at a version
    the bound then refuses, and dropped."""
    ahead = max_staleness * prompts_per_step
    capacity = max(1, ahead - prompts_per_step)
    return {"buffer.max_staleness": str(max_staleness), "buffer.capacity": str(capacity),
            "buffer.max_inflight_groups": str(max(1, ahead - capacity))}


def cell_overrides(max_staleness: int, objective: str, prompts_per_step: int, steps: int) -> dict[str, str]:
    """One fully_async cell: the schedule, the run-ahead for its bound, its objective and step count."""
    return {"loop.schedule": "fully_async", "loop.num_steps": str(steps),
            **run_ahead(max_staleness, prompts_per_step), **OBJECTIVES[objective]}


def steps_for_samples(samples: int, prompts_per_step: int, samples_per_prompt: int) -> int:
    """fully_async steps that train at least `samples` (each step collects prompts_per_step groups)."""
    return max(1, math.ceil(samples / (prompts_per_step * samples_per_prompt)))


def staleness_of(steps: list[dict]) -> dict[str, float]:
    """Mean and largest staleness over every trained group, from the per-step histogram
    `buffer/staleness/<k>` (groups trained k versions behind), and the groups dropped as too stale."""
    hist: dict[int, float] = {}
    for r in steps:
        for key, n in r.items():
            if key.startswith("buffer/staleness/"):
                k = int(key.rsplit("/", 1)[1])
                hist[k] = hist.get(k, 0.0) + n
    groups = sum(hist.values())
    return {"mean_staleness": sum(k * n for k, n in hist.items()) / groups if groups else 0.0,
            "max_staleness_seen": max((k for k, n in hist.items() if n), default=0),
            "staleness_histogram": {str(k): hist[k] for k in sorted(hist)},
            "dropped_stale": steps[-1].get("buffer/dropped_stale", 0.0) if steps else 0.0}


# Per-step figures of the importance weights, averaged over a run's steps where its objective reports them:
# how far the behaviour policy was from the trained one, and how many tokens each objective bounded.
WEIGHT_FIGURES = ("train/train_rollout_logprob_gap", "train/tis_weight_mean", "train/tis_clipped_frac",
                  "train/tis_ess", "decoupled_ppo/behav_weight_mean", "decoupled_ppo/clipped_frac_weight_cap",
                  "decoupled_ppo/behav_weight_le_0.5", "decoupled_ppo/behav_weight_le_2",
                  "decoupled_ppo/clipped_frac_ratio", "decoupled_ppo/behav_kl", "train/rollout_mismatch_kl",
                  "train/group_baseline_shift")


def figures(summary: dict, steps: list[dict]) -> dict:
    """One run's figures: eval accuracy, what it trained, how stale, its importance weights, how long."""
    weights = {k: statistics.fmean(r[k] for r in steps if k in r) for k in WEIGHT_FIGURES
               if any(k in r for r in steps)}
    return {"eval_accuracy": summary["eval_accuracy_after"], "eval_accuracy_before": summary["eval_accuracy_before"],
            "steps": len(steps), "trained_samples": int(sum(r.get("buffer/samples_trained", 0) for r in steps)),
            **staleness_of(steps), "weights": weights,
            "reward_mean": statistics.fmean(r.get("rollout/reward_mean", 0.0) for r in steps) if steps else 0.0,
            "wall_s": summary["wall_time_s"]}


def table(sync: list[dict], cells: dict[tuple[int, str], list[dict]]) -> dict:
    """The last line: per-seed runs folded into means, and the decoupled-PPO gap to sync at staleness 4."""
    mean = lambda runs, k: statistics.fmean(r[k] for r in runs)  # noqa: E731
    sync_acc = mean(sync, "eval_accuracy")
    rows = []
    for (s, objective), runs in cells.items():
        row = {"max_staleness": s, "objective": objective, "eval_accuracy": mean(runs, "eval_accuracy"),
               "mean_staleness": mean(runs, "mean_staleness"),
               "max_staleness_seen": max(r["max_staleness_seen"] for r in runs),
               "gap_points": 100 * (sync_acc - mean(runs, "eval_accuracy")),
               "trained_samples": mean(runs, "trained_samples"), "steps": runs[0]["steps"],
               "dropped_stale": mean(runs, "dropped_stale"),
               "weights": {k: statistics.fmean(r["weights"][k] for r in runs) for k in runs[0]["weights"]}}
        if len(runs) > 1:
            row["eval_accuracy_per_seed"] = [r["eval_accuracy"] for r in runs]
        rows.append(row)
    d4 = [r for r in rows if r["objective"] == "decoupled_ppo" and r["max_staleness"] == 4]
    return {"sync_eval_accuracy": sync_acc, "start_eval_accuracy": mean(sync, "eval_accuracy_before"),
            "sync_trained_samples": mean(sync, "trained_samples"), "cells": rows,
            "gap_points_decoupled_s4": d4[0]["gap_points"] if d4 else None,
            "gap_points_s4": {r["objective"]: r["gap_points"] for r in rows if r["max_staleness"] == 4}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench staleness", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="GRPO steps of the sync run; every cell trains as many samples")
    p.add_argument("--staleness", default="1,4,8", help="comma-separated buffer.max_staleness bounds, one cell each")
    p.add_argument("--only", default="", help=f"comma-separated objectives of {', '.join(OBJECTIVES)} "
                                              f"(default: {', '.join(DEFAULT_OBJECTIVES)})")
    p.add_argument("--seeds", default="0", help="comma-separated run.seed values; every run is repeated per seed")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--sft-model", default="", help="start from this warm-started checkpoint (skips the SFT)")
    p.add_argument("--sft-steps", type=int, default=None, help="cap on the SFT steps (default: sft.toml's)")
    p.add_argument("--preset", default="small-qwen3", help="model preset of the warm start (the example's)")
    p.add_argument("--match", default="samples", choices=("samples", "updates"),
                   help="what every cell shares with the sync run: its trained samples (the default; cells make "
                        "fewer, fuller updates) or its number of optimizer updates (cells then train more samples)")
    p.add_argument("--minibatches", type=int, default=1,
                   help="optimizer updates per step of every run, sync included (trainer.minibatches_per_step)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every run's engine and trainer (rollout.engine.num_threads, "
                        "trainer.num_threads): figures should not hang on one thread count")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every cell, not sync (repeatable), e.g. "
                        "--set trainer.algorithm.behav_kl_coef=0.3")
    p.add_argument("--out", default="", help="working folder (default: a temporary one)")
    args = p.parse_args(argv)
    if any("=" not in kv for kv in args.set):
        p.error("--set takes KEY=VALUE, e.g. --set trainer.algorithm.behav_kl_coef=0.3")
    cell_extra = dict(kv.split("=", 1) for kv in args.set)
    objectives = [n for n in args.only.split(",") if n] or list(DEFAULT_OBJECTIVES)
    unknown = set(objectives) - set(OBJECTIVES)
    if unknown:
        p.error(f"--only: unknown objectives {sorted(unknown)}; choose from {sorted(OBJECTIVES)}")
    try:
        bounds = [int(s) for s in args.staleness.split(",") if s]
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error("--staleness and --seeds take comma-separated integers, e.g. --staleness 1,4,8 --seeds 0,1")
    if not bounds or min(bounds) < 1 or not seeds:
        p.error("--staleness needs bounds >= 1 (e.g. 1,4,8) and --seeds at least one seed")
    if args.steps < 1 or args.minibatches < 1 or args.threads < 1:
        p.error("--steps, --minibatches and --threads must be at least 1")

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from miles.orchestration.ray_cluster import ensure_ray
    from miles.run_sections import RayConfig

    out = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-staleness-"))
    out.mkdir(parents=True, exist_ok=True)
    ensure_ray(RayConfig(num_cpus=2))  # a cluster of its own, whatever else runs here
    t0 = time.perf_counter()
    sft_model = warm_start(out, args.sft_model, args.preset, args.sft_steps)
    pps = args.prompts_per_step
    common = {"eval.num_prompts": str(args.eval_prompts), "rollout.prompts_per_step": str(pps),
              "rollout.n_samples_per_prompt": str(args.samples_per_prompt),
              "trainer.minibatches_per_step": str(args.minibatches),
              "trainer.num_threads": str(args.threads), "rollout.engine.num_threads": str(args.threads)}
    sync: list[dict] = []
    cells: dict[tuple[int, str], list[dict]] = {(s, o): [] for s in bounds for o in objectives}
    for seed in seeds:
        seeded = {**common, "run.seed": str(seed)}
        fig = figures(*rl_run(sft_model, out, f"sync-seed{seed}", {**seeded, "loop.num_steps": str(args.steps)}))
        sync.append(fig)
        print(f"[bench staleness] sync seed {seed}: {json.dumps(fig)}", file=sys.stderr, flush=True)
        # Equal trained samples: sync trains only the groups its filter keeps, so it may need fewer steps.
        # Equal updates: as many optimizer steps as sync made, each a full step of kept groups.
        steps = (steps_for_samples(fig["trained_samples"], pps, args.samples_per_prompt) if args.match == "samples"
                 else args.steps)
        for s, objective in cells:
            name = f"{objective}-s{s}-seed{seed}"
            over = {**seeded, **cell_overrides(s, objective, pps, steps), **cell_extra}
            cell = figures(*rl_run(sft_model, out, name, over))
            cells[(s, objective)].append(cell)
            print(f"[bench staleness] {name}: {json.dumps(cell)}", file=sys.stderr, flush=True)
    ray.shutdown()
    line = table(sync, cells)
    line.update({"steps": args.steps, "match": args.match, "minibatches": args.minibatches, "cell_overrides": cell_extra,
                 "threads": args.threads,
                 "sync": f"GRPO, sync schedule, {args.minibatches} optimizer update(s) per step",
                 "seeds": seeds, "prompts_per_step": pps,
                 "samples_per_prompt": args.samples_per_prompt, "eval_prompts": args.eval_prompts,
                 "sync_runs": sync, "wall_s": time.perf_counter() - t0})
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
