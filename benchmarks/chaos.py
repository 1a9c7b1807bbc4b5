"""`miles bench chaos`: break every kind of process of a training run, by step; nothing is lost.

The arithmetic job's GRPO (examples/arithmetic/grpo.toml: 32 prompts × 8 samples, exact-match reward)
from its SFT warm start (--sft-model DIR, or the SFT of examples/arithmetic/sft.toml run here
first), under schedule fully_async, two engines behind the router, a reward process pool, a
resumable checkpoint every step, weights pushed as disk deltas. The same run is made without faults
and with these, scheduled by training step (not wall time: a fast machine gets the same faults at
the same points):

  engine          SIGKILL a serving engine; the health monitor replaces it (fault.kill_engine_at_steps)
  trainer         SIGKILL the trainer rank; a new trainer group goes back to the last checkpoint
                  (fault.kill_trainer_at_steps, fault.restart_trainer)
  reward_worker   SIGKILL a reward pool worker; the pool is replaced and its calls made again
                  (fault.kill_reward_worker_at_steps)
  router          SIGKILL the router process; it is restarted on its port (fault.kill_router_at_steps)
  driver          the driver SIGKILLs its own process group (`miles train`, and with it its Ray
                  cluster) once a given step's checkpoint is committed (fault.kill_driver_at_step: its
                  own progress, so no later step's fault fires in it); the router (a process of its
                  own session) must keep answering /health; then `miles train --resume RUN_DIR`,
                  which must adopt that router
  stall           SIGSTOP a serving engine as the step's weight push starts (fault.stall_engine_at_steps);
                  every other one is sent SIGCONT --stall-resume-s later (past the push's per-call
                  deadline, so the attempt is rolled back and retried), the others never: the failed
                  push declares that engine dead, it is replaced, and the version goes to the rest
  corrupt_delta   flip a byte of the step's disk delta once written, before any engine reads it
                  (fault.corrupt_delta_at_steps); the engines' checksums refuse it, the version is
                  rolled back and written again
  stall_commit    SIGSTOP a serving engine between the commit round's readiness check and its commit
                  (fault.stall_engine_at_commit, --commit-stalls): the others commit, it is fenced
                  (serves nothing) and replaced, and the version goes to the rest again

With --quick the run is a smoke test of the same faults instead: the untrained tiny model, 8 prompts
× 4 samples, and a reward that an untrained model already varies on (the share of digits in the
response, `digit_fraction`), so every step trains; its eval (a digit anywhere in the answer) says
nothing about learning.

Last line, one JSON object:
  kills, by_kind           processes SIGKILLed (the driver's counted here), and every fault by kind
  run_completed            every step recorded once and the run wrote its summary
  prompts_lost             prompts drawn and neither trained nor pending: discarded because generation
                           failed (engine failure, timeout, abort) or unaccounted for
  prompts_trained_twice    groups trained in the recorded steps beyond the prompts the final ledger
                           holds as trained (a prompt trained in two recorded steps counts once here)
  hung_pushes              weight pushes (perf/sync_s) longer than their deadlines allow (see
                           push_bound_s), plus runs that outlived --timeout (hung_runs)
  push_faults_recovered    stalls and damaged deltas whose step's push was rolled back and retried
                           (sync/rollbacks), made again without the failed engine
                           (sync/engine_loss_retries), or held until the engine answered the
                           reconnect to a changed fleet (sync/reconnect_retries), and then verified
  pushes_unverified        pushes whose engines' checksums were not compared with the trainer's (an
                           engine on a mixed version fails that comparison)
  off_fleet_samples        trained samples with a segment from an engine older than the version the
                           whole fleet was known to hold when it was sent (rollout/off_fleet_samples)
  router_outlived_driver   the router answered /health while the killed driver was down;
  router_adopted           the resumed driver adopted it (summary.json router.adopted);
  routers_left_running     routers still running once every run ended (stopped here if so)
  eval_accuracy, eval_accuracy_without_faults   greedy accuracy on the same held-out prompts at the
                           end of each run (eval_accuracy_before: the warm start's)
  eval_accuracy_without_faults_by_seed, ..._spread   with --baselines N: the fault-free run for
                           seeds seed .. seed+N-1, and max - min of their accuracies
  reward_last_steps, reward_last_steps_without_faults   mean training reward of the last 4 steps
  wall_s, wall_s_without_faults
  checkpoints, checkpoints_without_faults   resumable checkpoints written (one a step, loop.save_every
                           = 1), their mean seconds and that as a share of the mean step time

    miles bench chaos [--sft-model DIR] [--steps 40] [--seed 0] [--kills-per-kind 3] [--driver-kill-at 2]
                      [--stalls 4] [--corrupt-deltas 2] [--commit-stalls 1] [--baselines 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from miles.orchestration.router_supervisor import RECORD, RouterRecord

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "arithmetic"
EXAMPLE = EXAMPLES / "grpo.toml"
FAILURE_REASONS = ("engine_failure", "timeout", "aborted")
# A version's deadline is generous (the first push fills every engine with noise and compares every
# tensor, slow on a loaded machine); a stalled engine fails the push at the per-call deadline instead.
SYNC_RETRIES, VERSION_TIMEOUT_S = 1, 120.0
LAST = 4  # steps whose mean training reward is compared between the two runs
# The order kill kinds take turns in. A trainer kill rewinds the run to the checkpoint before it,
# taking the record of the step it hit with it: so each one follows an engine kill (whose recovery is
# in the fleet's report, not in step records) and comes three steps after the last reward worker kill,
# whose restart is recorded by then.
KINDS = ("engine", "trainer", "reward_worker", "router")
KEYS = {"engine": "fault.kill_engine_at_steps", "reward_worker": "fault.kill_reward_worker_at_steps",
        "trainer": "fault.kill_trainer_at_steps", "router": "fault.kill_router_at_steps"}
NAMES = {"kill_engine": "engine", "kill_trainer": "trainer", "kill_reward_worker": "reward_worker",
         "kill_router": "router", "stall_engine": "stall", "corrupt_delta": "corrupt_delta",
         "stall_engine_at_commit": "stall_commit", "kill_driver": "driver"}
KILLS = ("engine", "trainer", "reward_worker", "router", "driver")


def digit_fraction(response: str, label) -> float:
    """The --quick run's reward: the share of the response's characters that are digits."""
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


def push_plan(kills: dict[str, list[int]], stalls: int, corrupt: int, resume_s: float,
              commit_stalls: int = 0) -> dict:
    """Steps of the push faults: the steps of trainer, reward worker and router kills (none of which
    touches the push that ends its step; the trainer's step is pushed once a new trainer has trained
    it again), in order; a damaged delta first, then a stall, by turns, then the stalls at commit. Stalls
    alternate between never resumed (the fleet replaces the engine) and resumed after resume_s."""
    slots = sorted(kills["trainer"] + kills["reward_worker"] + kills["router"])
    turn = [k for i in range(max(stalls, corrupt)) for k in ("corrupt_delta", "stall")[0 if i < corrupt else 1:
                                                                                         2 if i < stalls else 1]]
    turn += ["stall_commit"] * commit_stalls
    if len(turn) > len(slots):
        raise SystemExit(f"miles bench chaos: {len(turn)} push faults need as many steps with a trainer, reward "
                         f"worker or router kill, and the plan has {len(slots)}: raise --kills-per-kind or --steps")
    plan = {"stall": [], "corrupt_delta": [], "stall_resume_s": [], "stall_commit": []}
    for kind, step in zip(turn, slots):
        plan[kind].append(step)
        if kind == "stall":
            plan["stall_resume_s"].append(resume_s if len(plan["stall"]) % 2 == 0 else 0.0)
    return plan


def deadlines(push_deadline_s: float) -> dict[str, float]:
    """The weight push's deadlines (health probes wait as long as a push's call), and the longest a
    push may take by design: the fleet tries a version up to 3 times (an engine left it), each a run
    of (sync.retries + 1) attempts of at most sync.version_timeout_s plus a rollback call (at most
    sync.timeout_s), then one probe of every engine (health.timeout_s for /health_generate, then for
    /health)."""
    bound = 3 * ((SYNC_RETRIES + 1) * (VERSION_TIMEOUT_S + push_deadline_s) + 2 * push_deadline_s)
    return {"timeout_s": push_deadline_s, "version_timeout_s": VERSION_TIMEOUT_S, "health_timeout_s": push_deadline_s,
            "push_bound_s": bound}


def run_overrides(model: Path, out: Path, name: str, steps: int, seed: int, quick: bool,
                  push_deadline_s: float) -> dict[str, str]:
    limits = deadlines(push_deadline_s)
    over = {
        "model.path": str(model), "run.output_dir": str(out), "run.name": name, "run.seed": str(seed),
        "loop.schedule": "fully_async", "loop.num_steps": str(steps), "loop.save_every": "1",
        "rollout.num_engines": "2", "rollout.reward_config.num_workers": "1",
        "trainer.algorithm.tis_mode": "truncate", "eval.every_steps": "0",
        # Deltas: a killed engine's replacement joins through a catch-up delta from the base.
        "sync.transport": "disk_delta", "sync.delta_dir": str(out / f"{name}-deltas"),
        "sync.timeout_s": str(limits["timeout_s"]), "sync.version_timeout_s": str(limits["version_timeout_s"]),
        "sync.retries": str(SYNC_RETRIES),
        "health.interval_s": "0.5", "health.timeout_s": str(limits["health_timeout_s"]), "ray.num_cpus": "2",
        "metrics.progress": "off",
    }
    if quick:  # the untrained tiny model: small steps, a reward it already varies on
        over.update({"rollout.prompts_per_step": "8", "rollout.n_samples_per_prompt": "4",
                     "rollout.reward": f"{Path(__file__).resolve()}:digit_fraction",
                     "buffer.max_inflight_groups": "16", "buffer.capacity": "16", "buffer.max_staleness": "2",
                     "trainer.micro_batch_size": "64", "eval.num_prompts": "64", "sync.bucket_size_mb": "64"})
    else:  # the arithmetic job's GRPO as shipped, with fully_async's buffer of bench async --learn
        over.update({"buffer.max_inflight_groups": "64", "buffer.capacity": "64", "buffer.max_staleness": "2"})
    return over


def chaos_overrides(kills: dict[str, list[int]], pushes: dict, driver_at: int = 0) -> dict[str, str]:
    over = {"fault.restart_trainer": "true", "fault.max_trainer_restarts": str(max(1, len(kills["trainer"]))),
            "fault.kill_driver_at_step": str(driver_at), "health.standby_engines": "1", "router.own_process": "true"}
    for kind, steps in kills.items():
        if steps:
            over[KEYS[kind]] = ",".join(map(str, steps))
    if pushes["stall"]:
        over["fault.stall_engine_at_steps"] = ",".join(map(str, pushes["stall"]))
        over["fault.stall_resume_after_s"] = ",".join(f"{s:g}" for s in pushes["stall_resume_s"])
    if pushes["corrupt_delta"]:
        over["fault.corrupt_delta_at_steps"] = ",".join(map(str, pushes["corrupt_delta"]))
    if pushes.get("stall_commit"):
        over["fault.stall_engine_at_commit"] = ",".join(map(str, pushes["stall_commit"]))
    return over


def _miles(*args: str) -> list[str]:
    return [sys.executable, "-m", "miles.cli", *args]


def _command(over: dict[str, str]) -> list[str]:
    args = _miles("train", str(EXAMPLE))
    for key, value in over.items():
        args += [f"--{key}", value]
    return args


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)  # each run starts its own Ray cluster, which goes down with its driver
    return env


def router_answers(run_dir: Path) -> bool:
    """Whether the run's router (RUN_DIR/router.json) answers /health, with any status."""
    record = RouterRecord.load(run_dir / RECORD)
    if record is None:
        return False
    try:
        with urllib.request.urlopen(record.url + "/health", timeout=10):
            return True
    except urllib.error.HTTPError:
        return True  # an answer: 503 when no engine is left behind it
    except OSError:
        return False


def end_router(run_dir: Path) -> int:
    """SIGKILL the run's router if one is still running (a run that did not end cleanly); 1 if so."""
    record = RouterRecord.load(run_dir / RECORD)
    if record is None or record.host != socket.gethostname():
        return 0
    try:
        if b"miles.rollout.router" not in Path(f"/proc/{record.pid}/cmdline").read_bytes():
            return 0
    except OSError:
        return 0
    os.kill(record.pid, signal.SIGKILL)
    return 1


def run(args: list[str], log: Path, timeout_s: float, run_dir: Path | None = None) -> dict:
    """Run `miles train` in a process group of its own; a driver that SIGKILLed its group
    (fault.kill_driver_at_step, once that step's checkpoint is committed) is `killed`. Returns what
    happened (`router_answered`: the router answered /health after the kill)."""
    t0 = time.monotonic()
    with log.open("a") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return {"rc": None, "timed_out": True, "killed": False, "wall_s": time.monotonic() - t0,
                            "router_answered": None}
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    # The driver and its process group; Ray takes down what it owned, not the router.
    killed = proc.returncode == -signal.SIGKILL and run_dir is not None and "driver" in injected(run_dir)
    answered = None
    if killed:
        time.sleep(2.0)  # past the router's first health round without the dead driver's engines
        answered = router_answers(run_dir)
    return {"rc": proc.returncode, "timed_out": False, "killed": killed, "wall_s": time.monotonic() - t0,
            "router_answered": answered}


def warm_start(out: Path, seed: int, sft_steps: int, timeout_s: float) -> Path:
    """The arithmetic job's SFT warm start (examples/arithmetic/sft.toml on its model preset)."""
    base, model = out / "base", out / "sft-model"
    subprocess.run(_miles("init-model", "--preset", "small-qwen3", "--out", str(base)), cwd=REPO, env=_env(),
                   check=True, capture_output=True, timeout=timeout_s)
    args = _miles("sft", str(EXAMPLES / "sft.toml"), "--model.path", str(base), "--sft.out", str(model),
                  "--run.seed", str(seed), "--metrics.progress", "off")
    if sft_steps:
        args += ["--sft.steps", str(sft_steps)]
    with (out / "sft.log").open("a") as log:
        subprocess.run(args, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT, check=True,
                       timeout=timeout_s)
    return model


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def injected(run_dir: Path) -> dict[str, int]:
    """Faults injected per kind, from the run's faults.jsonl (written as each fires, so it holds those
    of a driver that was killed later, and of a run that failed)."""
    path = run_dir / "faults.jsonl"
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()] if path.exists() else []
    return dict(Counter(NAMES.get(k, k) for k in kinds))


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summary_of(run_dir: Path) -> dict | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def lost_prompts(ledger: dict) -> int:
    events = ledger.get("events", {})
    unaccounted = ledger["drawn"] - ledger["trained"] - ledger["discarded"] - ledger["pending"]
    return unaccounted + sum(events.get(f"discarded_{r}", 0) for r in FAILURE_REASONS)


def _verified(r: dict) -> bool:
    return bool(r.get("sync/verified_buckets") or r.get("sync/verified_tensors"))


def push_figures(recs: list[dict], pushes: dict) -> dict:
    """What the step records say about the weight pushes: rollbacks, retries without a failed engine,
    and whether each push fault's step ended in one of them, verified."""
    pushed = [r for r in recs if "sync/total_s" in r]
    by_step = {r["step"]: r for r in recs}
    recovered = 0
    for step in pushes["stall"] + pushes["corrupt_delta"] + pushes.get("stall_commit", []):
        r = by_step.get(step, {})
        # A stall ends in a rollback, a push without the stalled engine, or (when the push began by
        # reconnecting to a changed fleet) in reconnect retries until the engine answered again; a stall at
        # commit in a fenced engine and the version made again without it.
        if (r.get("sync/rollbacks", 0) or r.get("sync/engine_loss_retries", 0)
                or r.get("sync/reconnect_retries", 0)) and _verified(r):
            recovered += 1
    return {"push_faults_recovered": recovered,
            "off_fleet_samples": int(sum(r.get("rollout/off_fleet_samples", 0) for r in recs)),
            "rollbacks": sum(int(r.get("sync/rollbacks", 0)) for r in recs),
            "engine_loss_retries": sum(int(r.get("sync/engine_loss_retries", 0)) for r in recs),
            "reconnect_retries": sum(int(r.get("sync/reconnect_retries", 0)) for r in recs),
            "fenced_engines": sum(int(r.get("sync/fenced_engines", 0)) for r in recs),
            "pushes_unverified": sum(not _verified(r) for r in pushed)}


def ledger_figures(run_dir: Path, steps: int, bound_s: float) -> dict:
    """What the run directory says about the run: completed, lost, trained twice, hung pushes."""
    summary = summary_of(run_dir)
    recs = [r for r in records(run_dir) if r["step"] > 0]
    recorded = [r["step"] for r in recs]
    completed = summary is not None and recorded == list(range(1, steps + 1))
    trained_groups = sum(int(r.get("buffer/groups_trained", 0)) for r in recs)
    out = {"run_completed": completed, "steps_recorded": len(recorded),
           "prompts_lost": None, "prompts_trained_twice": None,
           "hung_pushes": sum(r.get("perf/sync_s", 0.0) > bound_s for r in recs),
           "max_push_s": max((r.get("perf/sync_s", 0.0) for r in recs), default=None),
           "eval_accuracy": summary["eval_accuracy_after"] if summary else None,
           "eval_accuracy_before": summary["eval_accuracy_before"] if summary else None,
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
    p.add_argument("--sft-model", default="", help="the arithmetic job's warm start to train from (default: run "
                   "the SFT of examples/arithmetic/sft.toml first)")
    p.add_argument("--sft-steps", type=int, default=0, help="sft.steps of that SFT (0: sft.toml's, which stops at "
                   "its target accuracy)")
    p.add_argument("--quick", action="store_true", help="a smoke test of the same faults on the untrained tiny "
                   "model (8 prompts × 4 samples, a digit-share reward); no SFT")
    p.add_argument("--steps", type=int, default=40, help="training steps of each run")
    p.add_argument("--seed", type=int, default=0, help="run.seed of both runs (and of the SFT)")
    p.add_argument("--kills-per-kind", type=int, default=3, help="step-scheduled kills of each process kind")
    p.add_argument("--driver-kill-at", type=int, default=2,
                   help="kill the driver once this step's checkpoint exists, then resume (0: never); early, so "
                        "that the resumed driver's summary covers every other fault")
    p.add_argument("--stalls", type=int, default=4, help="engines SIGSTOPped as a push starts; every second one "
                   "is resumed, the others never")
    p.add_argument("--stall-resume-s", type=float, default=25.0,
                   help="seconds before a resumed stall's SIGCONT: past the push's per-call deadline plus the delta's "
                        "writing (the attempt is rolled back), short of two missed health probe rounds, 4 times the "
                        "deadline (the engine is not replaced)")
    p.add_argument("--corrupt-deltas", type=int, default=2, help="pushes whose disk delta is damaged once written")
    p.add_argument("--commit-stalls", type=int, default=1, help="engines SIGSTOPped between a push's readiness "
                   "check and its commit (fault.stall_engine_at_commit): fenced and replaced")
    p.add_argument("--push-deadline-s", type=float, default=10.0, help="sync.timeout_s, the deadline of each call "
                   "of a push, and health.timeout_s (sync.version_timeout_s is 120 s)")
    p.add_argument("--baselines", type=int, default=1, help="fault-free runs, seeds seed .. seed+N-1: their spread "
                   "is what timing alone does to a fully_async run's accuracy")
    p.add_argument("--no-baseline", action="store_true", help="skip the fault-free runs")
    p.add_argument("--timeout", type=float, default=3600, help="seconds each `miles train` may take")
    p.add_argument("--out", default="", help="working folder (default: a temporary one)")
    args = p.parse_args(argv)
    driver_at = args.driver_kill_at
    limits = deadlines(args.push_deadline_s)

    out = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    kills = kill_plan(args.steps, args.kills_per_kind, driver_at)
    pushes = push_plan(kills, args.stalls, args.corrupt_deltas, args.stall_resume_s, args.commit_stalls)
    t0 = time.monotonic()
    if args.quick:
        from miles.models.presets import build_tiny_model

        model = build_tiny_model("tiny-qwen3", out / "model")
    else:
        model = Path(args.sft_model) if args.sft_model else warm_start(out, args.seed, args.sft_steps, args.timeout)
    line: dict = {"workload": "quick" if args.quick else "arithmetic", "model": str(model), "steps": args.steps,
                  "seed": args.seed, "plan": {**kills, "driver": [driver_at] if driver_at else [], **pushes},
                  "push_bound_s": limits["push_bound_s"]}
    if not args.quick and not args.sft_model:
        line["sft_s"] = time.monotonic() - t0

    def overrides(name: str, seed: int) -> dict[str, str]:
        return run_overrides(model, out / "runs", name, args.steps, seed, args.quick, args.push_deadline_s)

    # The run under faults first: its figures matter most if the machine's time runs out.
    chaos_dir = out / "runs" / "chaos"
    t0 = time.monotonic()
    first = run(_command({**overrides("chaos", args.seed), **chaos_overrides(kills, pushes, driver_at)}),
                out / "chaos.log", args.timeout, run_dir=chaos_dir)
    resumed = None
    if first["killed"]:
        resumed = run(_miles("train", "--resume", str(chaos_dir)), out / "chaos.log", args.timeout)
    figures = ledger_figures(chaos_dir, args.steps, limits["push_bound_s"])
    left = end_router(chaos_dir)
    faults = figures.pop("faults", None) or {}
    by_kind = injected(chaos_dir)
    line.update({"kills": sum(n for k, n in by_kind.items() if k in KILLS), "by_kind": by_kind, **figures,
                 **push_figures([r for r in records(chaos_dir) if r["step"] > 0], pushes),
                 "engines_recovered": faults.get("recovered"), "mean_engine_recovery_s": faults.get("mean_recovery_s"),
                 "router_restarts": ((summary_of(chaos_dir) or {}).get("router") or {}).get("restarts"),
                 "reward_worker_restarts": sum(r.get("reward/worker_restarts", 0) for r in records(chaos_dir)),
                 "wall_s": time.monotonic() - t0,
                 "hung_runs": int(first["timed_out"] or bool(resumed and resumed["timed_out"])),
                 "router_outlived_driver": first["router_answered"],
                 "router_adopted": ((summary_of(chaos_dir) or {}).get("router") or {}).get("adopted"),
                 "routers_left_running": left})
    print(f"[bench chaos] with faults: {json.dumps(line)}", file=sys.stderr, flush=True)

    if not args.no_baseline and args.baselines > 0:
        by_seed = {}
        for i in range(args.baselines):
            seed = args.seed + i
            name = "baseline" if i == 0 else f"baseline-seed{seed}"
            t0 = time.monotonic()
            base = run(_command(overrides(name, seed)), out / f"{name}.log", args.timeout)
            line["routers_left_running"] += end_router(out / "runs" / name)
            base_figures = ledger_figures(out / "runs" / name, args.steps, limits["push_bound_s"])
            by_seed[seed] = base_figures["eval_accuracy"]
            print(f"[bench chaos] without faults, seed {seed}: {json.dumps(base_figures)}", file=sys.stderr, flush=True)
            if i:
                continue
            line.update({"eval_accuracy_without_faults": base_figures["eval_accuracy"],
                         "eval_accuracy_before_without_faults": base_figures["eval_accuracy_before"],
                         "reward_last_steps_without_faults": base_figures["reward_last_steps"],
                         "checkpoints_without_faults": base_figures["checkpoints"],
                         "run_completed_without_faults": base_figures["run_completed"],
                         "hung_pushes_without_faults": base_figures["hung_pushes"],
                         "wall_s_without_faults": time.monotonic() - t0, "baseline_hung": int(base["timed_out"])})
        if args.baselines > 1:
            accs = [a for a in by_seed.values() if a is not None]
            line["eval_accuracy_without_faults_by_seed"] = by_seed
            line["eval_accuracy_without_faults_spread"] = max(accs) - min(accs) if accs else None
        if line["eval_accuracy"] is not None and line["eval_accuracy_without_faults"] is not None:
            line["eval_accuracy_diff_points"] = 100 * (line["eval_accuracy"] - line["eval_accuracy_without_faults"])
    line["out"] = str(out)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
