"""`miles bench async`: what overlapping generation and training buys on long-tailed rollouts.

Same tiny model, prompts, step count and cores for every schedule. Response lengths are long-tailed
(rollout.response_lengths = "long_tail": most samples short, a few up to max_new_tokens), the shape
where a synchronous step waits on its slowest sample. Compared:
  sync colocated     engines and trainer take turns, each with every core (threads = cores)
  sync disaggregated half the cores each, still taking turns
  one_step_off       half the cores each, generation of step k+1 overlaps training of step k
  fully_async        half the cores each, engines never wait; max_staleness bounds the lag
Throughput is trained samples per second of loop time in the steady state: steps after the first
--warmup-steps (which fill the pipeline and warm the engines up) up to N-1 (the last step also runs
the final evaluation). Every schedule runs --rounds times in alternating order (A B C D, D C B A, ...)
and its figure pools its rounds, so drift in the machine's speed weighs on all of them alike.
`ratio` = fully_async / the faster sync setup. With --pacing the fully-async run
is repeated with buffer.pacing on, and for both runs the mean response length of the groups dropped
as stale is reported beside the mean of all groups (which prompts each mode throws away).
Last line: one JSON object.

With --learn it instead checks that the arithmetic example still learns under fully_async: one SFT
warm start of the example's model (or --sft-model, an existing one), then GRPO with the sync schedule for --learn-steps steps and fully_async for as many
steps as it takes to train the same number of samples; eval accuracy gain of each (same held-out
prompts, greedy) and `gain_gap` = sync gain − fully_async gain (done when <= 0.05).

    miles bench async [--steps 12] [--warmup-steps 1] [--rounds 2] [--prompts-per-step 8] [--max-new-tokens 192] [--inflight-groups N] [--pacing]
    miles bench async --learn [--learn-steps 40] [--sft-steps 600] [--preset small-qwen3] [--sft-model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def schedules(args) -> dict[str, dict[str, str]]:
    ncores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    half = str(max(1, ncores // 2))
    disagg = {"placement.mode": "disaggregated", "rollout.engine.num_threads": half, "trainer.num_threads": half}
    # One step's worth in flight and one ready: enough to keep the engine's batch full without
    # letting groups wait so long in the buffer that they go stale.
    inflight = str(args.inflight_groups or args.prompts_per_step)
    overlap = {**disagg, "buffer.max_staleness": str(args.max_staleness),
               "buffer.max_inflight_groups": inflight, "buffer.capacity": inflight}
    runs = {
        "sync_colocated": {"placement.mode": "colocated", "rollout.engine.num_threads": str(ncores),
                           "trainer.num_threads": str(ncores)},
        "sync_disaggregated": disagg,
        "one_step_off": {**overlap, "loop.schedule": "one_step_off"},
        "fully_async": {**overlap, "loop.schedule": "fully_async"},
    }
    if args.pacing:
        runs["fully_async_pacing"] = {**runs["fully_async"], "buffer.pacing": "true"}
    return runs


def figures(run_dir: Path, warmup_steps: int = 0) -> dict:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["step"] > 0]
    timed = steps[warmup_steps:-1] or steps
    samples = sum(r.get("buffer/samples_trained", 0) for r in timed)
    seconds = sum(r["perf/step_s"] for r in timed)
    stale = [r["buffer/staleness_mean"] for r in steps if "buffer/staleness_mean" in r]
    last = steps[-1]
    out = {"samples_per_s": samples / seconds, "samples": samples, "loop_s": seconds,
           "mean_staleness": sum(stale) / max(len(stale), 1),
           "dropped_stale": last.get("buffer/dropped_stale", 0.0),
           "response_len_mean": sum(r.get("rollout/response_len_mean", 0) for r in steps) / len(steps),
           "train_s_mean": sum(r.get("perf/train_s", 0) for r in timed) / len(timed)}
    if "buffer/stale_response_len_mean" in last:
        out["stale_response_len_mean"] = last["buffer/stale_response_len_mean"]
    return out


def pooled(rounds: list[dict]) -> dict:
    """One schedule's figures over its rounds: samples per second of all timed loop time together."""
    samples, seconds = sum(r["samples"] for r in rounds), sum(r["loop_s"] for r in rounds)
    mean = lambda k: sum(r[k] for r in rounds) / len(rounds)  # noqa: E731
    out = {"samples_per_s": samples / seconds, "samples": samples, "loop_s": seconds,
           "mean_staleness": mean("mean_staleness"), "dropped_stale": sum(r["dropped_stale"] for r in rounds),
           "response_len_mean": mean("response_len_mean"), "train_s_mean": mean("train_s_mean"),
           "rounds_samples_per_s": [r["samples_per_s"] for r in rounds], "ledgers": [r["ledger"] for r in rounds]}
    stale = [r["stale_response_len_mean"] for r in rounds if "stale_response_len_mean" in r]
    if stale:
        out["stale_response_len_mean"] = sum(stale) / len(stale)
    return out


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "arithmetic"


def learn(args, out: Path) -> dict:
    """Sync vs fully_async GRPO on the arithmetic example at equal trained samples."""
    import math

    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.models.presets import build_tiny_model
    from miles.orchestration.driver import run_sft, run_train

    sft_model = args.sft_model
    if not sft_model:
        base = build_tiny_model(args.preset, out / "base")
        sft_model = str(out / "sft-model")
        run_sft(load_config(RunConfig, EXAMPLE / "sft.toml", {
            "model.path": str(base), "sft.out": sft_model, "sft.steps": str(args.sft_steps),
            "metrics.progress": "plain"}))
    common = {"model.path": sft_model, "run.output_dir": str(out / "runs"), "eval.every_steps": "0",
              "eval.num_prompts": str(args.eval_prompts), "loop.save_every": "0", "metrics.progress": "plain"}
    runs = {}
    sync = run_train(load_config(RunConfig, EXAMPLE / "grpo.toml", {
        **common, "run.name": "learn_sync", "loop.num_steps": str(args.learn_steps)}))
    pps = 32  # grpo.toml's rollout.prompts_per_step
    fa_steps = max(1, math.ceil(sync["ledger"]["trained"] / pps))
    fa = run_train(load_config(RunConfig, EXAMPLE / "grpo.toml", {
        **common, "run.name": "learn_fully_async", "loop.num_steps": str(fa_steps), "loop.schedule": "fully_async",
        "buffer.max_staleness": str(args.max_staleness), "buffer.max_inflight_groups": str(2 * pps),
        "trainer.algorithm.tis_mode": "truncate"}))
    for name, summary in (("sync", sync), ("fully_async", fa)):
        recs = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        stale = [r["buffer/staleness_mean"] for r in recs if "buffer/staleness_mean" in r]
        runs[name] = {"steps": summary["steps"], "trained_groups": summary["ledger"]["trained"],
                      "trained_samples": sum(r.get("buffer/samples_trained", 0) for r in recs),
                      "eval_accuracy_before": summary["eval_accuracy_before"],
                      "eval_accuracy_after": summary["eval_accuracy_after"],
                      "gain": summary["eval_accuracy_after"] - summary["eval_accuracy_before"],
                      "mean_staleness": sum(stale) / max(len(stale), 1), "wall_s": summary["wall_time_s"]}
        print(f"[bench async] learn {name}: {json.dumps(runs[name])}", file=sys.stderr, flush=True)
    return {"sync_gain": runs["sync"]["gain"], "fully_async_gain": runs["fully_async"]["gain"],
            "gain_gap": runs["sync"]["gain"] - runs["fully_async"]["gain"], "runs": runs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench async", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of every schedule, in alternating order (A B C D D C B A); figures pool them")
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="first steps left out of the throughput (pipeline fill, engine warm-up)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--inflight-groups", type=int, default=0,
                   help="buffer.max_inflight_groups and buffer.capacity of the overlapped runs (default: one step's)")
    p.add_argument("--pacing", action="store_true", help="also run fully_async with buffer.pacing on")
    p.add_argument("--only", default="", help="comma-separated schedules (default: all)")
    p.add_argument("--out", default="", help="working folder (default: a temporary one)")
    p.add_argument("--learn", action="store_true", help="sync vs fully_async learning on the arithmetic example")
    p.add_argument("--learn-steps", type=int, default=40)
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--preset", default="small-qwen3", help="model preset of the warm start (the example's)")
    p.add_argument("--sft-model", default="", help="reuse this SFT checkpoint instead of training one")
    p.add_argument("--eval-prompts", type=int, default=256)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if not args.learn and args.steps < args.warmup_steps + 2:
        p.error(f"--steps {args.steps} leaves no timed step after {args.warmup_steps} warm-up step(s) and the "
                f"final one; use --steps {args.warmup_steps + 3} or more")

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    out = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-async-"))
    out.mkdir(parents=True, exist_ok=True)
    import ray

    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.models.presets import build_tiny_model
    from miles.orchestration.driver import run_train

    runs = schedules(args)
    names = [n for n in args.only.split(",") if n] or list(runs)
    unknown = set(names) - set(runs)
    if unknown:
        sys.exit(f"miles bench async: unknown schedules {sorted(unknown)}; choose from {sorted(runs)}")
    from miles.orchestration.ray_cluster import ensure_ray
    from miles.run_sections import RayConfig

    ensure_ray(RayConfig(num_cpus=2))  # a cluster of its own, whatever else runs here
    t0 = time.perf_counter()
    if args.learn:
        line = learn(args, out)
        ray.shutdown()
        print(json.dumps({**line, "wall_s": time.perf_counter() - t0}), flush=True)
        return 0
    model = build_tiny_model("tiny-qwen3", out / "model")
    base = {"model.path": str(model), "run.output_dir": str(out / "runs"), "loop.num_steps": str(args.steps),
            "rollout.prompts_per_step": str(args.prompts_per_step),
            "rollout.n_samples_per_prompt": str(args.samples_per_prompt),
            "rollout.max_new_tokens": str(args.max_new_tokens), "rollout.response_lengths": "long_tail",
            "rollout.reward": "text_parity", "buffer.filter": "nonzero_std",
            "eval.every_steps": "0", "eval.num_prompts": "8", "eval.max_new_tokens": "4",
            # Packed micro-batches: training cost follows the tokens trained, not the longest sample.
            "trainer.lr": "1e-4", "trainer.pack_sequences": "true", "trainer.max_tokens_per_micro_batch": "4096",
            "sync.bucket_size_mb": "64",
            "metrics.progress": "plain"}
    per_round: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        # A B C D, then D C B A: a machine that speeds up or slows down during the benchmark
        # weighs on every schedule alike.
        for name in names if r % 2 == 0 else names[::-1]:
            cfg = load_config(RunConfig, None, {**base, **runs[name], "run.name": f"{name}-r{r}"})
            summary = run_train(cfg)
            fig = figures(Path(summary["run_dir"]), args.warmup_steps)
            fig["ledger"] = summary["ledger"]
            per_round[name].append(fig)
            print(f"[bench async] {name} round {r}: {json.dumps(fig)}", file=sys.stderr, flush=True)
    ray.shutdown()
    results = {n: pooled(rs) for n, rs in per_round.items()}

    def rate(n):
        return results[n]["samples_per_s"] if n in results else None

    syncs = [rate(n) for n in ("sync_colocated", "sync_disaggregated") if rate(n)]
    best_sync = max(syncs) if syncs else None
    fa = results.get("fully_async", {})
    line = {"sync_samples_per_s": best_sync, "sync_colocated_samples_per_s": rate("sync_colocated"),
            "sync_disaggregated_samples_per_s": rate("sync_disaggregated"),
            "one_step_off_samples_per_s": rate("one_step_off"), "fully_async_samples_per_s": rate("fully_async"),
            "ratio": fa["samples_per_s"] / best_sync if fa and best_sync else None,
            "one_step_off_ratio": rate("one_step_off") / best_sync if rate("one_step_off") and best_sync else None,
            "mean_staleness": fa.get("mean_staleness"), "dropped_stale": fa.get("dropped_stale"),
            "max_staleness": args.max_staleness, "steps": args.steps, "warmup_steps": args.warmup_steps,
            "rounds": args.rounds,
            "prompts_per_step": args.prompts_per_step,
            "samples_per_prompt": args.samples_per_prompt, "max_new_tokens": args.max_new_tokens,
            "runs": results, "wall_s": time.perf_counter() - t0}
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
