"""`miles bench faults`: engines die during a fully-async run; the run goes on and nothing is lost.

The arithmetic example's prompts (examples/arithmetic/grpo.toml) on the tiny model, schedule
fully_async, two engines behind the router, and the fault injector SIGKILLs a serving engine every
--every seconds, --kills times. The health monitor finds each dead engine, a standby engine takes
its slot, gets a full verified weight push at the trainer's version and is admitted by the router;
the other engine keeps generating throughout, and requests the dead engine held are retried on it.

The reward is text parity (as in `miles bench async`): exact match on an untrained tiny model is
always 0, so every group would be filtered and the trainer would never step. The figures here are
about staying up, not learning.

Last line, one JSON object:
  kills, recovered        engine kills injected; slots serving again afterwards
  run_completed           every step trained and the run wrote its summary
  lost_prompts            prompts drawn and not trained, retried or pending: discarded because
                          generation failed (engine failure, timeout, abort) or unaccounted for
  mean_recovery_s         from the SIGKILL to the router admitting the replacement (max_recovery_s too)

    miles bench faults [--kills 3] [--every 20] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "arithmetic"
FAILURE_REASONS = ("engine_failure", "timeout", "aborted")


def lost_prompts(ledger: dict) -> int:
    events = ledger.get("events", {})
    unaccounted = ledger["drawn"] - ledger["trained"] - ledger["discarded"] - ledger["pending"]
    return unaccounted + sum(events.get(f"discarded_{r}", 0) for r in FAILURE_REASONS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3, help="engine kills to inject")
    p.add_argument("--every", type=float, default=20.0, help="seconds between two kills")
    p.add_argument("--first-after", type=float, default=6.0, help="seconds into the loop of the first kill")
    p.add_argument("--steps", type=int, default=60, help="training steps (enough to outlast the kills)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--standby", type=int, default=2, help="health.standby_engines")
    p.add_argument("--out", default="", help="working folder (default: a temporary one)")
    args = p.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    out = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    import ray

    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.models.presets import build_tiny_model
    from miles.orchestration.driver import run_train

    model = build_tiny_model("tiny-qwen3", out / "model")
    overrides = {
        "model.path": str(model), "run.output_dir": str(out / "runs"), "run.name": "faults",
        "loop.schedule": "fully_async", "loop.num_steps": str(args.steps), "loop.save_every": "0",
        "rollout.num_engines": str(args.engines), "rollout.prompts_per_step": "8",
        "rollout.n_samples_per_prompt": "4", "rollout.reward": "text_parity",
        "buffer.max_inflight_groups": "16", "buffer.capacity": "16", "buffer.max_staleness": "2",
        "trainer.micro_batch_size": "64", "trainer.algorithm.tis_mode": "truncate",
        "eval.every_steps": "0", "eval.num_prompts": "16", "sync.bucket_size_mb": "64",
        "health.interval_s": "0.5", "health.timeout_s": "5", "health.standby_engines": str(args.standby),
        "fault.kill_engine_every_s": str(args.every), "fault.first_fault_after_s": str(args.first_after),
        "fault.max_engine_faults": str(args.kills), "metrics.progress": "plain",
    }
    cfg = load_config(RunConfig, EXAMPLE / "grpo.toml", overrides)
    from miles.orchestration.ray_cluster import ensure_ray
    from miles.run_sections import RayConfig

    ensure_ray(RayConfig(num_cpus=2))  # a cluster of its own, whatever else runs here
    t0 = time.perf_counter()
    summary, error = None, None
    try:
        summary = run_train(cfg)
    except Exception as exc:  # noqa: BLE001 - a run that fails is a result of this benchmark
        error = f"{type(exc).__name__}: {exc}"
        print(f"[bench faults] the run failed: {error}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    run_dir = Path(summary["run_dir"]) if summary else out / "runs" / "faults"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    steps_done = max((r["step"] for r in records), default=0)
    faults = (summary or {}).get("faults", {})
    fleet = (summary or {}).get("fleet", {})
    line = {
        "kills": faults.get("kills", 0), "recovered": faults.get("recovered", 0),
        "run_completed": summary is not None and steps_done == args.steps,
        "lost_prompts": lost_prompts(summary["ledger"]) if summary else None,
        "mean_recovery_s": faults.get("mean_recovery_s"), "max_recovery_s": faults.get("max_recovery_s"),
        "replacements": fleet.get("replacements"), "steps": steps_done,
        "ledger": summary["ledger"] if summary else None,
        "recovery_s": [f.get("recovery_s") for f in faults.get("faults", [])],
        "engines": args.engines, "standby_engines": args.standby, "kill_every_s": args.every,
        "error": error, "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
