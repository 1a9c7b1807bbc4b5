"""`miles bench lowprec`: the rollout–trainer mismatch each low-precision format causes, and what
training in the format (QAT) and truncated importance sampling (TIS) do about it, next to BF16.

The tiny Qwen3 preset is served by a built-in engine and trained by the float32 FSDP trainer in a short
GRPO run (generate over HTTP → reward → one optimizer step → weights into the engine), from the same
checkpoint and seeds in every run:
  bf16 baseline   a bfloat16 engine, a float32 trainer
  rollout_only    a float32 engine serving the format (rollout.engine.quantization), a float32 trainer
  tis             the same, with trainer.algorithm.tis_mode = "truncate"
  qat_tis         the engine and the trainer both in the format (trainer.quantization), with TIS
Reported per run, averaged over the steps: mismatch_kl (train/rollout_mismatch_kl, the k3 estimate of
KL(engine ‖ trainer) on the sampled tokens), mismatch_frac (share of tokens off by more than 0.1 nats),
logprob_diff (mean |Δlogprob|) and the reward. wire_bytes_ratio_vs_bf16 is the bytes a weight push to
an engine serving the format hands its transport (sync/bytes: Linear weights as the format's bytes and
scales, the rest in bfloat16) over a push to a bfloat16 engine. The reward (share of digit characters) only gives GRPO a signal to follow: this
run is about consistency, not learning. One JSON line per run, then a summary line.

With `--eval-model DIR` (a checkpoint that does the arithmetic task, e.g. the SFT model of
examples/arithmetic/run.sh), it also serves that one checkpoint in bfloat16 and in each format and
prints one line `{"eval": "greedy_accuracy", "eval_accuracy_bf16": …, "formats": {fmt: acc}, …}`: the
greedy accuracy on the same held-out problems (the task as examples/arithmetic/sft.toml sets it up),
so the accuracy a format costs a trained policy, served without retraining, is measured.

With `--rl --sft-model DIR` it instead measures learning: from that one warm start of the arithmetic job
(examples/arithmetic/sft.toml), a GRPO run of examples/arithmetic/grpo.toml for `--rl-steps` steps with
a bfloat16 engine (the baseline) and, for each format, one run per recipe (`--recipes`, default
rollout_only,qat_tis). Each run's eval accuracy (greedy, the same held-out problems) is taken by its
own engine, served the way the recipe serves. One JSON line per run (eval accuracy before and after,
the gap to the baseline in points, the mean mismatch), then a summary line with
`max_gap_points_full_recipe`, the largest bf16-minus-qat_tis gap. The recipe qat_tis_embeddings is the
full recipe with the (tied) embedding and LM head in the format too (quantize_embeddings on both
sides); `--quantize-embeddings` adds the same to the `--eval-model` line.

    miles bench lowprec [--formats fp8,mxfp8,nvfp4,int4] [--steps 4] [--prompts 6] [--samples 4]
                        [--eval-model DIR] [--eval-problems 256] [--eval-only]
    miles bench lowprec --rl --sft-model DIR [--rl-steps 60] [--recipes rollout_only,qat_tis]
                        [--formats ...] [--eval-prompts 256] [--out DIR] [--bf16-accuracy ACC]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# The engine and trainer settings of each recipe, for a format; the baseline is a bfloat16 engine.
BASELINE = {"rollout.engine.dtype": "bfloat16"}
RECIPES = {
    "rollout_only": lambda fmt: {"rollout.engine.dtype": "float32", "rollout.engine.quantization": fmt},
    "tis": lambda fmt: {**RECIPES["rollout_only"](fmt), "trainer.algorithm.tis_mode": "truncate"},
    "qat_tis": lambda fmt: {**RECIPES["tis"](fmt), "trainer.quantization": fmt},
    # The full recipe with the (tied) embedding and LM head in the format too, on both sides.
    "qat_tis_embeddings": lambda fmt: {**RECIPES["qat_tis"](fmt), "rollout.engine.quantize_embeddings": "true",
                                       "trainer.quantize_embeddings": "true"},
}


def digit_share(text: str, _label=None) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def wire_bytes_ratio(model_dir: str, fmt: str, embeddings: bool = False) -> float:
    """Bytes a weight push hands the transport (sync/bytes) to an engine serving `fmt`, over those to a
    bfloat16 engine: the Linear weights (and with `embeddings`, the embedding and LM head) travel as the
    format's bytes and scales, the rest in bfloat16."""
    from miles.models.loading import load_model
    from miles.precision.linear import quantize_linears, served_weights
    from miles.sync.prepare import push_weights

    class Count:  # the push's own byte count is the figure; nothing needs to arrive anywhere
        def send_bucket(self, bucket):
            pass

        def commit(self, version):
            pass

    model = load_model(model_dir, "float32")
    quantize_linears(model, fmt, "serve", embeddings=embeddings)
    quantized = {n: f for n, (f, _) in served_weights(model).items()}
    named, seen = [], set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:  # tied weights travel once
            seen.add(t.data_ptr())
            named.append((name, t))
    bf16 = push_weights(iter(named), Count(), 1, dtype="bfloat16")["sync/bytes"]
    return push_weights(iter(named), Count(), 1, dtype="bfloat16", quantized=quantized)["sync/bytes"] / bf16


def eval_accuracy(model_dir: str, engine_dtype: str, fmt: str, problems, max_new_tokens: int | None = None,
                  embeddings: bool = False) -> float:
    """Greedy accuracy of `model_dir` served in `engine_dtype` with its Linear weights (and with
    `embeddings`, its embedding and LM head) in `fmt`: the share of `problems` whose completion (at most
    `max_new_tokens`, default two more than the answer's characters), stripped, is exactly the answer."""
    import httpx

    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=model_dir, dtype=engine_dtype, quantization=fmt,
                                              quantize_embeddings=embeddings, seed=0))

    async def solve_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            async def solve(p):
                r = await c.post("/generate", json={"text": p.prompt, "sampling_params": {
                    "temperature": 0.0, "max_new_tokens": max_new_tokens or len(p.answer) + 2}})
                r.raise_for_status()
                return r.json()["text"].strip() == p.answer
            return await asyncio.gather(*(solve(p) for p in problems))

    try:
        return sum(asyncio.run(solve_all())) / len(problems)
    finally:
        server.stop()


def eval_formats(model_dir: str, formats: list[str], n: int, embeddings: bool = False) -> dict:
    """The eval line: the same checkpoint's greedy accuracy served bfloat16 and in each format (and with
    `embeddings`, in each format with the embedding and LM head in it too)."""
    from miles.data.tasks.arithmetic import ArithmeticTask

    problems = ArithmeticTask(digits=2, ops="+-", split="eval", seed=0, fixed_width=True).take(n)
    t0 = time.perf_counter()
    bf16 = eval_accuracy(model_dir, "bfloat16", "none", problems)
    accs = {fmt: eval_accuracy(model_dir, "float32", fmt, problems) for fmt in formats}
    line = {"eval": "greedy_accuracy", "model": model_dir, "problems": n, "eval_accuracy_bf16": bf16,
            "formats": accs, "max_gap_points": max((100 * (bf16 - a) for a in accs.values()), default=0.0)}
    if embeddings:
        line["formats_with_embeddings"] = {fmt: eval_accuracy(model_dir, "float32", fmt, problems, embeddings=True)
                                           for fmt in formats}
        line["wire_bytes_ratio_vs_bf16"] = {fmt: wire_bytes_ratio(model_dir, fmt) for fmt in formats}
        line["wire_bytes_ratio_vs_bf16_with_embeddings"] = {fmt: wire_bytes_ratio(model_dir, fmt, True)
                                                            for fmt in formats}
    return {**line, "wall_s": time.perf_counter() - t0}


def run(model_dir: str, engine_dtype: str, engine_format: str, trainer_format: str, tis: bool, args) -> dict:
    import httpx
    import torch

    from miles.buffer.filters import nonzero_std
    from miles.buffer.types import Group
    from miles.config.loader import build
    from miles.net import free_port
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread
    from miles.rollout.generate import SamplingParams, generate
    from miles.trainer.trainer import Trainer
    from miles.trainer.batching import prepare_global_batch, sequences_from_groups
    from miles.trainer.config import TrainerConfig

    cfg = build(TrainerConfig, {"lr": args.lr, "quantization": trainer_format,
                                "algorithm": {"name": "grpo", "tis_mode": "truncate" if tis else "off"}})
    trainer = Trainer(cfg, model_dir, 0, 1, "127.0.0.1", free_port(), seed=0)
    server = start_server_thread(EngineConfig(model_path=model_dir, dtype=engine_dtype, quantization=engine_format,
                                              seed=0))
    prompts = [[3 + p, 17 + 5 * p, 9, 40 + p] for p in range(args.prompts)]
    steps = []
    try:
        for step in range(args.steps):
            async def rollout():
                async with httpx.AsyncClient(timeout=600) as c:
                    return await asyncio.gather(*(
                        generate(c, server.url, ids, SamplingParams(max_new_tokens=args.max_new_tokens,
                                                                    seed=1000 * step + 10 * p + k), prompt_index=p)
                        for p, ids in enumerate(prompts) for k in range(args.samples)))
            samples = asyncio.run(rollout())
            for s in samples:
                s.reward = digit_share(s.response_text)
            groups = [Group(samples[i:i + args.samples]) for i in range(0, len(samples), args.samples)]
            seqs = sequences_from_groups([g for g in groups if nonzero_std(g)], trainer.algorithm)
            if not seqs:
                continue
            seqs, totals = prepare_global_batch(seqs, trainer.algorithm)
            m = trainer.train_step(seqs, totals)
            steps.append({"mismatch_kl": m["train/rollout_mismatch_kl"],
                          "mismatch_frac": m["train/rollout_mismatch_frac"],
                          "logprob_diff": m["train/rollout_logprob_abs_diff"],
                          "reward": sum(s.reward for s in samples) / len(samples)})
            with torch.no_grad():
                server.engine.apply_weights(dict(trainer.full_named_tensors()), step + 1)
    finally:
        server.stop()
    if not steps:
        raise SystemExit("miles bench lowprec: no step had a group with unequal rewards; raise --samples")
    return {**{k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}, "steps_trained": len(steps)}


def _sibling(name: str):
    """Another benchmark of this folder, loaded by path as `miles bench` loads them."""
    spec = importlib.util.spec_from_file_location(f"miles_bench_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rl_cells(args, formats: list[str], recipes: list[str]) -> int:
    """The --rl mode: one GRPO run per cell from the same warm start, eval accuracy per cell."""
    algorithms = _sibling("algorithms")
    out = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-lowprec-rl-"))
    sft_model = out / "sft-model"  # a copy: a run never writes into the checkpoint it was given
    if not sft_model.exists():
        shutil.copytree(args.sft_model, sft_model)
    common = {"eval.num_prompts": str(args.eval_prompts), "rollout.prompts_per_step": str(args.prompts_per_step),
              **dict(o.split("=", 1) for o in args.override)}
    load_before = os.getloadavg()
    import ray

    ours = not ray.is_initialized()  # a cluster someone else started is left running
    algorithms.start_ray()

    def cell(name: str, fmt: str, recipe: str, over: dict) -> dict:
        t = time.perf_counter()
        r, steps = algorithms.rl_run(sft_model, out, name, {**common, "loop.num_steps": str(args.rl_steps), **over})
        wall_s = time.perf_counter() - t
        row = {"format": fmt, "recipe": recipe, "eval_accuracy_before": r["eval_accuracy_before"],
               "eval_accuracy": r["eval_accuracy_after"],
               "mismatch_kl": algorithms.mean_of(steps, "train/rollout_mismatch_kl"),
               "mismatch_frac": algorithms.mean_of(steps, "train/rollout_mismatch_frac"),
               "reward_first10": algorithms.mean_of(steps[:10], "rollout/reward_mean"),
               "reward_last10": algorithms.mean_of(steps[-10:], "rollout/reward_mean"),
               "steps": len(steps), "wall_s": wall_s, "loadavg_1m": os.getloadavg()[0]}
        return row

    t0 = time.perf_counter()
    summary = {"mode": "rl", "sft_model": args.sft_model, "rl_steps": args.rl_steps,
               "eval_prompts": args.eval_prompts, "formats": {}}
    if args.bf16_accuracy is None:
        base = cell("bf16", "bf16", "baseline", BASELINE)
        bf16 = base["eval_accuracy"]
        print(json.dumps({**base, "eval_accuracy_bf16": bf16, "gap_points": 0.0}), flush=True)
        summary["eval_accuracy_bf16_before"] = base["eval_accuracy_before"]
    else:  # the baseline of an earlier invocation with the same warm start and settings
        bf16 = args.bf16_accuracy
    summary["eval_accuracy_bf16"] = bf16
    for fmt in formats:
        row = {"wire_bytes_ratio_vs_bf16": wire_bytes_ratio(str(sft_model), fmt)}
        if any("embeddings" in r for r in recipes):
            row["wire_bytes_ratio_vs_bf16_with_embeddings"] = wire_bytes_ratio(str(sft_model), fmt, True)
        for recipe in recipes:
            r = cell(f"{fmt}-{recipe}", fmt, recipe, RECIPES[recipe](fmt))
            ratio = row["wire_bytes_ratio_vs_bf16_with_embeddings" if "embeddings" in recipe
                        else "wire_bytes_ratio_vs_bf16"]
            r.update(eval_accuracy_bf16=bf16, gap_points=100 * (bf16 - r["eval_accuracy"]),
                     wire_bytes_ratio_vs_bf16=ratio)
            print(json.dumps(r), flush=True)
            row[recipe] = r["eval_accuracy"]
        summary["formats"][fmt] = row
    if ours:
        ray.shutdown()
    gaps = [100 * (bf16 - row["qat_tis"]) for row in summary["formats"].values() if "qat_tis" in row]
    summary.update(max_gap_points_full_recipe=max(gaps) if gaps else None, loadavg_before=load_before,
                   loadavg_after=os.getloadavg(), wall_s=time.perf_counter() - t0)
    print(json.dumps(summary), flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench lowprec", description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="fp8,mxfp8,nvfp4,int4")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-model", default="", help="a checkpoint that does the arithmetic task: also print "
                   "its greedy eval accuracy served bfloat16 and in each format")
    p.add_argument("--eval-problems", type=int, default=256)
    p.add_argument("--eval-only", action="store_true", help="only the eval line (needs --eval-model)")
    p.add_argument("--rl", action="store_true", help="eval accuracy after a GRPO run per format and recipe, "
                   "from the warm start --sft-model")
    p.add_argument("--sft-model", default="", help="with --rl: the arithmetic job's SFT warm start (copied)")
    p.add_argument("--rl-steps", type=int, default=60)
    p.add_argument("--recipes", default="rollout_only,qat_tis", help=f"with --rl: any of {', '.join(RECIPES)}")
    p.add_argument("--eval-prompts", type=int, default=256, help="with --rl: held-out eval problems per run")
    p.add_argument("--prompts-per-step", type=int, default=32, help="with --rl: prompts per GRPO step")
    p.add_argument("--out", default="", help="with --rl: working folder (default: a temporary one)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="with --rl: a run config override for every cell (repeatable)")
    p.add_argument("--bf16-accuracy", type=float, default=None, help="with --rl: skip the baseline run and "
                   "compare with this eval accuracy (an earlier baseline of the same warm start and settings)")
    p.add_argument("--quantize-embeddings", action="store_true", help="with --eval-model: also serve each format "
                   "with the embedding and LM head in it (rollout.engine.quantize_embeddings), and give the wire "
                   "bytes both ways")
    args = p.parse_args(argv)
    if args.eval_only and not args.eval_model:
        p.error("--eval-only needs --eval-model DIR")
    if args.rl and not args.sft_model:
        p.error("--rl needs --sft-model DIR (the SFT model of examples/arithmetic/run.sh)")
    bad = [o for o in args.override if "=" not in o]
    if bad:
        p.error(f"--override {bad[0]!r}: give KEY=VALUE, e.g. --override rollout.temperature=1.2")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        p.error(f"--recipes: unknown {', '.join(unknown)}; choose from {', '.join(RECIPES)}")

    import torch
    import torch.distributed as dist

    from miles.models.presets import build_tiny_model
    from miles.net import free_port
    from miles.precision.types import get_format

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        get_format(f, "--formats")
    torch.set_num_threads(1)
    if args.rl:
        return rl_cells(args, formats, recipes)
    if args.eval_model:
        print(json.dumps(eval_formats(args.eval_model, formats, args.eval_problems, args.quantize_embeddings)),
              flush=True)
        if args.eval_only:
            return 0
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    t0 = time.perf_counter()
    summary = {"model": "tiny-qwen3", "steps": args.steps, "samples_per_step": args.prompts * args.samples,
               "formats": {}}
    with tempfile.TemporaryDirectory(prefix="miles-bench-lowprec-") as tmp:
        model_dir = str(build_tiny_model("tiny-qwen3", tmp))
        base = run(model_dir, "bfloat16", "none", "none", False, args)
        print(json.dumps({"format": "bf16", "recipe": "baseline", **base}), flush=True)
        summary.update(mismatch_kl_bf16=base["mismatch_kl"], mismatch_frac_bf16=base["mismatch_frac"],
                       reward_bf16=base["reward"])
        for fmt in formats:
            row = {"wire_bytes_ratio_vs_bf16": wire_bytes_ratio(model_dir, fmt)}
            for recipe, trainer_format, tis in (("rollout_only", "none", False), ("tis", "none", True),
                                                ("qat_tis", fmt, True)):
                r = run(model_dir, "float32", fmt, trainer_format, tis, args)
                print(json.dumps({"format": fmt, "recipe": recipe, **r,
                                  "wire_bytes_ratio_vs_bf16": row["wire_bytes_ratio_vs_bf16"]}), flush=True)
                row[recipe] = {"mismatch_kl": r["mismatch_kl"], "mismatch_frac": r["mismatch_frac"],
                               "reward": r["reward"]}
            summary["formats"][fmt] = row
    dist.destroy_process_group()
    summary["wall_s"] = time.perf_counter() - t0
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
