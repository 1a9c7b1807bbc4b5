"""`miles bench distill`: on-policy distillation against GRPO from the same weak start, side by side.

The arithmetic example's model (`small-qwen3`) is warm-started by SFT to a low held-out accuracy (the
student, `--student-target`), then trained further by the same SFT to a high one (the teacher,
`--teacher-target`: the same preset trained longer). From the student checkpoint, two runs of
`examples/arithmetic/grpo.toml`, one after the other:
  opd   `trainer.algorithm.name = "opd"`: pure distillation (reward_coef 0, kl_coef 1, per-token reverse
        KL as the advantage), the teacher served by an engine of its own (or inside the trainer with
        `--teacher-in trainer`); every group is trained (buffer.filter = "none": the teacher's signal
        is in groups whose rewards all agree too)
  grpo  the example as shipped (exact-match reward, zero-variance groups dropped)
Same steps, prompts per step, samples per prompt and max new tokens, so the same sampling budget;
same learning rate, clip range, seed and held-out eval problems (greedy exact match, every
`--eval-every` steps). The teacher's accuracy is measured by `miles eval` on the same problems.
Last line: one JSON object with `opd_eval_accuracy`, `grpo_eval_accuracy`, `start_eval_accuracy`,
`teacher_eval_accuracy`, each run's eval curve and per-step figures.

    miles bench distill [--steps 40] [--student-target 0.3] [--teacher-target 0.9] [--seed 0]
    miles bench distill --student-model DIR --teacher-model DIR   # reuse both checkpoints
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from miles.config import load_config
from miles.run_config import RunConfig
from miles.run_eval import run_eval
from miles.models.presets import build_tiny_model
from miles.orchestration.driver import run_sft, run_train

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "arithmetic"


def sft(model: str, out: Path, target: float, max_steps: int, seed: int) -> dict:
    """examples/arithmetic/sft.toml from `model` until held-out greedy accuracy reaches `target`."""
    return run_sft(load_config(RunConfig, EXAMPLE / "sft.toml", {
        "model.path": model, "sft.out": str(out), "sft.target_accuracy": str(target),
        "sft.steps": str(max_steps), "run.seed": str(seed), "metrics.progress": "plain"}))


def run_configs(args, student: str, teacher: str, out: Path) -> dict[str, RunConfig]:
    """The two runs, from the student checkpoint: examples/arithmetic/grpo.toml at this bench's size, the
    same for both but for the algorithm (and the filter pure distillation needs)."""
    shared = {"model.path": student, "run.output_dir": str(out / "runs"), "run.seed": str(args.seed),
              "loop.num_steps": str(args.steps), "loop.save_every": "0", "eval.every_steps": str(args.eval_every),
              "eval.num_prompts": str(args.eval_prompts), "rollout.prompts_per_step": str(args.prompts_per_step),
              "rollout.n_samples_per_prompt": str(args.samples), "metrics.progress": "plain"}
    opd = {"run.name": "opd", "trainer.algorithm.name": "opd", "trainer.algorithm.opd.kl_coef": str(args.kl_coef),
           "trainer.algorithm.opd.reward_coef": "0", "buffer.filter": "none"}
    if args.teacher_in == "engines":
        opd.update({"teacher.model.path": teacher, "teacher.num_engines": "1"})
    else:
        opd["trainer.algorithm.opd.teacher_path"] = teacher
    variants = {"opd": opd, "grpo": {"run.name": "grpo"}}
    return {name: load_config(RunConfig, EXAMPLE / "grpo.toml", {**shared, **variants[name]})
            for name in args.only}


def curve(run_dir: Path) -> dict:
    """A run's eval accuracy by step and its per-step figures, from its metrics.jsonl."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["step"] > 0]
    per_step = lambda k: [round(r[k], 4) if k in r else None for r in steps]  # noqa: E731
    return {"eval_accuracy_by_step": {str(r["step"]): r["eval/accuracy"] for r in recs if "eval/accuracy" in r},
            "reward_mean": per_step("rollout/reward_mean"), "reverse_kl": per_step("opd/reverse_kl"),
            "samples_trained": sum(r.get("buffer/samples_trained", 0) for r in steps)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench distill", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps of each run")
    p.add_argument("--prompts-per-step", type=int, default=32, help="grpo.toml's")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (grpo.toml's)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--student-target", type=float, default=0.3, help="SFT stops the student at this accuracy")
    p.add_argument("--teacher-target", type=float, default=0.9, help="SFT trains the teacher on to this accuracy")
    p.add_argument("--sft-steps", type=int, default=1500, help="the most steps either SFT phase runs")
    p.add_argument("--kl-coef", type=float, default=1.0, help="trainer.algorithm.opd.kl_coef")
    p.add_argument("--teacher-in", choices=("engines", "trainer"), default="engines",
                   help="engines: teacher.model.path (an engine of its own); trainer: opd.teacher_path")
    p.add_argument("--student-model", default="", help="reuse this student checkpoint (skips its SFT)")
    p.add_argument("--teacher-model", default="", help="reuse this teacher checkpoint (skips its SFT)")
    p.add_argument("--preset", default="small-qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated: opd, grpo (default: both)")
    p.add_argument("--quick", action="store_true", help="smoke-sized: tiny-qwen3, 2 SFT steps without targets, "
                   "2 steps of 4 prompts x 2 samples, 8 eval prompts")
    p.add_argument("--out", default="", help="working folder (default: a temporary one)")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.sft_steps, args.student_target, args.teacher_target = "tiny-qwen3", 2, 0.0, 0.0
        args.steps, args.prompts_per_step, args.samples, args.eval_prompts, args.eval_every = 2, 4, 2, 8, 1
    args.only = [n for n in args.only.split(",") if n] or ["opd", "grpo"]
    if set(args.only) - {"opd", "grpo"}:
        p.error(f"--only: unknown {sorted(set(args.only) - {'opd', 'grpo'})}; choose from opd, grpo")
    if args.steps < 1 or args.eval_every < 1:
        p.error("--steps and --eval-every must be >= 1")
    if not (0 <= args.student_target <= 1 and 0 <= args.teacher_target <= 1):
        p.error("--student-target and --teacher-target are accuracies in [0, 1]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from miles.orchestration.ray_cluster import ensure_ray
    from miles.run_sections import RayConfig

    out = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-distill-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ensure_ray(RayConfig(num_cpus=2))  # a cluster of its own, whatever else runs here
    line: dict = {}
    student = args.student_model
    if not student:
        base = str(build_tiny_model(args.preset, out / "base", seed=args.seed))
        student = str(out / "student")
        s = sft(base, Path(student), args.student_target, args.sft_steps, args.seed)
        line["student_sft"] = {"steps": s["steps"], "held_out_accuracy": s.get("held_out_accuracy")}
    teacher = args.teacher_model
    if not teacher:
        # The same preset trained longer: SFT goes on from the student's weights.
        teacher = str(out / "teacher")
        s = sft(student, Path(teacher), args.teacher_target, args.sft_steps, args.seed)
        line["teacher_sft"] = {"extra_steps": s["steps"], "held_out_accuracy": s.get("held_out_accuracy")}
    teacher_eval = run_eval(load_config(RunConfig, EXAMPLE / "grpo.toml", {
        "model.path": teacher, "run.seed": str(args.seed), "eval.num_prompts": str(args.eval_prompts)}))
    line["teacher_eval_accuracy"] = teacher_eval["eval/accuracy"]
    print(f"[bench distill] teacher eval accuracy {line['teacher_eval_accuracy']:.3f}", file=sys.stderr, flush=True)

    runs = {}
    for name, cfg in run_configs(args, student, teacher, out).items():
        t = time.perf_counter()
        summary = run_train(cfg)
        runs[name] = {"eval_accuracy_before": summary["eval_accuracy_before"],
                      "eval_accuracy_after": summary["eval_accuracy_after"], **curve(Path(summary["run_dir"])),
                      "wall_s": round(time.perf_counter() - t, 1)}
        print(f"[bench distill] {name}: {json.dumps(runs[name])}", file=sys.stderr, flush=True)
    ray.shutdown()
    first = runs[args.only[0]]
    line = {"opd_eval_accuracy": runs["opd"]["eval_accuracy_after"] if "opd" in runs else None,
            "grpo_eval_accuracy": runs["grpo"]["eval_accuracy_after"] if "grpo" in runs else None,
            # Both runs evaluate the student before their first step, on the same problems.
            "start_eval_accuracy": first["eval_accuracy_before"], **line,
            "steps": args.steps, "prompts_per_step": args.prompts_per_step, "samples_per_prompt": args.samples,
            "samples_per_run": args.steps * args.prompts_per_step * args.samples, "eval_prompts": args.eval_prompts,
            "teacher_in": args.teacher_in, "kl_coef": args.kl_coef, "seed": args.seed, "preset": args.preset,
            "student_model": student, "teacher_model": teacher, "runs": runs,
            "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
