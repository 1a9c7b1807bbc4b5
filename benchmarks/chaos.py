"""`miles bench chaos`: kill every kind of process of a training run, by step; nothing is lost.

The arithmetic example's prompts (examples/arithmetic/grpo.toml) on the tiny model, schedule
fully_async, two engines behind the router, a reward process pool, a resumable checkpoint every
step. The same run is made twice with the same seed: once without faults, once with these kills,
scheduled by training step (not wall time: a fast machine gets the same kills at the same points):

  engine          SIGKILL a serving engine; the health monitor replaces it (fault.kill_engine_at_steps)
  trainer         SIGKILL the trainer rank; a new trainer group goes back to the last checkpoint
                  (fault.kill_trainer_at_steps, fault.restart_trainer)
  reward_worker   SIGKILL a reward pool worker; the pool is replaced and its calls made again
                  (fault.kill_reward_worker_at_steps)
  router          SIGKILL the router process; it is restarted on its port (fault.kill_router_at_steps)
  driver          this program SIGKILLs the driver (`miles train`, and with it its Ray cluster) once a
                  given step's checkpoint exists, then runs `miles train --resume RUN_DIR`

The reward is the share of digits in the response (`digit_fraction` below): an untrained tiny model
already varies on it, so every step trains, and RL moves it. Eval accuracy is then the share of the
64 held-out prompts whose greedy response holds a digit at all (eval counts a score > 0 as correct):
exact-match accuracy of an untrained tiny model is 0 with or without faults, which would compare
nothing.

Last line, one JSON object:
  kills, by_kind           kills injected, in all and per kind (the driver's counted here)
  run_completed            every step recorded once and the run wrote its summary
  prompts_lost             prompts drawn and neither trained nor pending: discarded because generation
                           failed (engine failure, timeout, abort) or unaccounted for
  prompts_trained_twice    groups trained in the recorded steps beyond the prompts the final ledger
                           holds as trained (a prompt trained in two recorded steps counts once here)
  hung_pushes              weight pushes (perf/sync_s) longer than their deadlines allow (3 tries of
                           (sync.retries + 1) attempts of sync.version_timeout_s), plus runs that
                           outlived --timeout (hung_runs)
  eval_accuracy, eval_accuracy_without_faults   the last evaluation of each run
  reward_last_steps, reward_last_steps_without_faults   mean training reward of the last 4 steps
  wall_s, wall_s_without_faults
  checkpoints, checkpoints_without_faults   resumable checkpoints written (one a step, loop.save_every
                           = 1), their mean seconds and that as a share of the mean step time

    miles bench chaos [--steps 16] [--seed 0] [--kills-per-kind 3] [--driver-kill-at 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "arithmetic" / "grpo.toml"
FAILURE_REASONS = ("engine_failure", "timeout", "aborted")
SYNC_TIMEOUT_S, VERSION_TIMEOUT_S, SYNC_RETRIES = 30.0, 60.0, 1
# The longest a push may take by design: the fleet tries a version up to 3 times (an engine died in
# it), each a run of (sync.retries + 1) attempts with a deadline of sync.version_timeout_s each.
PUSH_BOUND_S = 3 * (SYNC_RETRIES + 1) * VERSION_TIMEOUT_S
LAST = 4  # steps whose mean training reward is compared between the two runs
# The order kinds take turns in. A trainer kill rewinds the run to the checkpoint before it, taking
# the record of the step it hit with it: so each one follows an engine kill (whose recovery is in
# the fleet's report, not in step records) and comes three steps after the last reward worker kill,
# whose restart is recorded by then.
KINDS = ("engine", "trainer", "reward_worker", "router")
KEYS = {"engine": "fault.kill_engine_at_steps", "reward_worker": "fault.kill_reward_worker_at_steps",
        "trainer": "fault.kill_trainer_at_steps", "router": "fault.kill_router_at_steps"}


def digit_fraction(response: str, label) -> float:
    """The run's reward: the share of the response's characters that are digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def kill_plan(steps: int, per_kind: int, driver_at: int) -> dict[str, list[int]]:
    """Steps at which each kind is killed: kinds take turns over steps 2 .. steps-1, one kill a step,
    skipping the step the driver is killed at and the one after it (the resumed run's first)."""
    free = [s for s in range(2, steps) if s not in (driver_at, driver_at + 1)]
    plan: dict[str, list[int]] = {k: [] for k in KINDS}
    turn = [k for _ in range(per_kind) for k in KINDS]
    for kind, step in zip(turn, free):
        plan[kind].append(step)
    return plan


def run_overrides(model: Path, out: Path, name: str, steps: int, seed: int) -> dict[str, str]:
    return {
        "model.path": str(model), "run.output_dir": str(out), "run.name": name, "run.seed": str(seed),
        "loop.schedule": "fully_async", "loop.num_steps": str(steps), "loop.save_every": "1",
        "rollout.num_engines": "2", "rollout.prompts_per_step": "8", "rollout.n_samples_per_prompt": "4",
        "rollout.max_new_tokens": "6", "rollout.reward": f"{Path(__file__).resolve()}:digit_fraction",
        "rollout.reward_config.num_workers": "1",
        "buffer.max_inflight_groups": "16", "buffer.capacity": "16", "buffer.max_staleness": "2",
        "trainer.micro_batch_size": "64", "trainer.algorithm.tis_mode": "truncate",
        "eval.every_steps": "0", "eval.num_prompts": "64", "sync.bucket_size_mb": "64",
        # Deltas: a killed engine's replacement joins through a catch-up delta from the base.
        "sync.transport": "disk_delta", "sync.delta_dir": str(out / f"{name}-deltas"),
        "sync.timeout_s": str(SYNC_TIMEOUT_S), "sync.version_timeout_s": str(VERSION_TIMEOUT_S),
        "sync.retries": str(SYNC_RETRIES),
        "health.interval_s": "0.5", "health.timeout_s": "5", "ray.num_cpus": "2", "metrics.progress": "off",
    }


def chaos_overrides(plan: dict[str, list[int]]) -> dict[str, str]:
    over = {"fault.restart_trainer": "true", "fault.max_trainer_restarts": str(max(1, len(plan["trainer"]))),
            "health.standby_engines": "1", "router.own_process": "true"}
    for kind, steps in plan.items():
        if steps:
            over[KEYS[kind]] = ",".join(map(str, steps))
    return over


def _command(over: dict[str, str]) -> list[str]:
    args = [sys.executable, "-m", "miles.cli", "train", str(EXAMPLE)]
    for key, value in over.items():
        args += [f"--{key}", value]
    return args


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)  # each run starts its own Ray cluster, which goes down with its driver
    return env


def _checkpoint_step(run_dir: Path) -> int:
    try:
        return int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    except (OSError, ValueError, IndexError):
        return -1


def run(args: list[str], log: Path, timeout_s: float, kill_at: int = 0, run_dir: Path | None = None) -> dict:
    """Run `miles train`; with kill_at, SIGKILL it once step kill_at's checkpoint exists. Returns what happened."""
    t0 = time.monotonic()
    with log.open("a") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        killed = False
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return {"rc": None, "timed_out": True, "killed": False, "wall_s": time.monotonic() - t0}
                if kill_at and not killed and _checkpoint_step(run_dir) >= kill_at:
                    proc.send_signal(signal.SIGKILL)  # the driver alone: Ray takes down what it owned
                    killed = True
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return {"rc": proc.returncode, "timed_out": False, "killed": killed, "wall_s": time.monotonic() - t0}


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def injected(run_dir: Path) -> dict[str, int]:
    """Faults injected per kind, from the run's faults.jsonl (written as each fires, so it holds those
    of a driver that was killed later, and of a run that failed)."""
    path = run_dir / "faults.jsonl"
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()] if path.exists() else []
    return dict(Counter(k.removeprefix("kill_") for k in kinds))


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summary_of(run_dir: Path) -> dict | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def lost_prompts(ledger: dict) -> int:
    events = ledger.get("events", {})
    unaccounted = ledger["drawn"] - ledger["trained"] - ledger["discarded"] - ledger["pending"]
    return unaccounted + sum(events.get(f"discarded_{r}", 0) for r in FAILURE_REASONS)


def ledger_figures(run_dir: Path, steps: int) -> dict:
    """What the run directory says about the run: completed, lost, trained twice, hung pushes."""
    summary = summary_of(run_dir)
    recs = [r for r in records(run_dir) if r["step"] > 0]
    recorded = [r["step"] for r in recs]
    completed = summary is not None and recorded == list(range(1, steps + 1))
    trained_groups = sum(int(r.get("buffer/groups_trained", 0)) for r in recs)
    out = {"run_completed": completed, "steps_recorded": len(recorded),
           "prompts_lost": None, "prompts_trained_twice": None,
           "hung_pushes": sum(r.get("perf/sync_s", 0.0) > PUSH_BOUND_S for r in recs),
           "max_push_s": max((r.get("perf/sync_s", 0.0) for r in recs), default=None),
           "eval_accuracy": summary["eval_accuracy_after"] if summary else None,
           "reward_last_steps": _mean([r["rollout/reward_mean"] for r in recs[-LAST:] if "rollout/reward_mean" in r]),
           "trainer_restarts": summary.get("trainer_restarts") if summary else None,
           "checkpoints": summary.get("checkpoints") if summary else None,
           "ledger": summary["ledger"] if summary else None}
    if summary is not None:
        out["prompts_lost"] = lost_prompts(summary["ledger"])
        out["prompts_trained_twice"] = trained_groups - summary["ledger"]["trained"]
        out["faults"] = summary.get("faults")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16, help="training steps of each run")
    p.add_argument("--seed", type=int, default=0, help="run.seed of both runs")
    p.add_argument("--kills-per-kind", type=int, default=3, help="step-scheduled kills of each process kind")
    p.add_argument("--driver-kill-at", type=int, default=2,
                   help="kill the driver once this step's checkpoint exists, then resume (0: never); early, so "
                        "that the resumed driver's summary covers every other kill")
    p.add_argument("--no-baseline", action="store_true", help="skip the fault-free run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds each `miles train` may take")
    p.add_argument("--out", default="", help="working folder (default: a temporary one)")
    args = p.parse_args(argv)
    driver_at = args.driver_kill_at

    from miles.models.presets import build_tiny_model

    out = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model("tiny-qwen3", out / "model")
    plan = kill_plan(args.steps, args.kills_per_kind, driver_at)
    line: dict = {"steps": args.steps, "seed": args.seed, "plan": {**plan, "driver": [driver_at] if driver_at else []}}

    # The run under faults first: its figures matter most if the machine's time runs out.
    chaos_dir = out / "runs" / "chaos"
    over = {**run_overrides(model, out / "runs", "chaos", args.steps, args.seed), **chaos_overrides(plan)}
    t0 = time.monotonic()
    first = run(_command(over), out / "chaos.log", args.timeout, kill_at=driver_at, run_dir=chaos_dir)
    resumed = None
    if first["killed"]:
        resumed = run([sys.executable, "-m", "miles.cli", "train", "--resume", str(chaos_dir)], out / "chaos.log",
                      args.timeout)
    figures = ledger_figures(chaos_dir, args.steps)
    faults = figures.pop("faults", None) or {}
    by_kind = injected(chaos_dir)
    if first["killed"]:
        by_kind["driver"] = 1
    line.update({"kills": sum(by_kind.values()), "by_kind": by_kind, **figures,
                 "engines_recovered": faults.get("recovered"), "mean_engine_recovery_s": faults.get("mean_recovery_s"),
                 "router_restarts": ((summary_of(chaos_dir) or {}).get("router") or {}).get("restarts"),
                 "reward_worker_restarts": sum(r.get("reward/worker_restarts", 0) for r in records(chaos_dir)),
                 "wall_s": time.monotonic() - t0,
                 "hung_runs": int(first["timed_out"] or bool(resumed and resumed["timed_out"]))})

    if not args.no_baseline:
        base_dir = out / "runs" / "baseline"
        t0 = time.monotonic()
        base = run(_command(run_overrides(model, out / "runs", "baseline", args.steps, args.seed)),
                   out / "baseline.log", args.timeout)
        base_figures = ledger_figures(base_dir, args.steps)
        line.update({"eval_accuracy_without_faults": base_figures["eval_accuracy"],
                     "reward_last_steps_without_faults": base_figures["reward_last_steps"],
                     "checkpoints_without_faults": base_figures["checkpoints"],
                     "run_completed_without_faults": base_figures["run_completed"],
                     "wall_s_without_faults": time.monotonic() - t0, "baseline_hung": int(base["timed_out"])})
        if line["eval_accuracy"] is not None and base_figures["eval_accuracy"] is not None:
            line["eval_accuracy_diff_points"] = 100 * (line["eval_accuracy"] - base_figures["eval_accuracy"])
    line["out"] = str(out)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
