"""`miles bench trl`: miles against TRL's GRPOTrainer on the same job, side by side in one run.

Contenders, each from the same SFT checkpoint, on the same prompts in the same order:
  trl                TRL's GRPOTrainer in this process (transformers generation, reward, loss, AdamW)
  miles_sync         `miles train`, sync schedule, engine and trainer taking turns on every core
  miles_fully_async  `miles train`, fully_async, half the cores each, max_staleness bounds the lag
Workloads:
  short  the arithmetic example's GRPO phase as shipped (examples/arithmetic/grpo.toml: 32 prompts x 8
         samples, 6 new tokens, exact match)
  long   generation dominates: the same problems in a long format, the answer then `=answer` repeated
         (`045=045=045`), reward on the first answer only (benchmarks/_answer_first.py), max_new_tokens
         256. A second, short supervised pass on top of the SFT checkpoint teaches the format with
         repeat counts drawn from a Pareto(1.2) law (long_tail_length over 4x the budget, capped), so
         both sides sample their long-tailed lengths from the policy and stop at EOS. miles' own
         `rollout.response_lengths = "long_tail"` (lengths forced per sample, EOS ignored) has no TRL
         counterpart, which is why the length law lives in the model here.
Figure: samples per second = prompts x samples per step x steps / training-loop wall time (generation,
reward, training and weight sync; evaluation excluded on both sides: TRL runs none, miles' final
eval is subtracted). Eval accuracy: one function (`evaluate`) for every contender's final weights,
greedy transformers decoding of held-out problems scored by the workload's reward. Per workload:
`ratio` (fully_async / TRL), `sync_ratio` (sync / TRL), and `best_schedule` with its `best_ratio`: the
faster miles schedule of those that ran, whose eval is `miles_eval_accuracy` and sets `eval_gap_points`
(TRL's accuracy minus it, in points).
Every setting the two cannot share is listed in `unmatched_settings`. Last line: one JSON object.
Device: cpu (default), or `--device cuda`: every contender on the one GPU, bf16 compute over float32
master weights on both sides (TRL's bf16 autocast; miles' engine in bf16, trainer param_dtype bf16),
TRL generating with transformers (vLLM is not available there), miles with its engine's fast decode.

    miles bench trl [--workloads short,long] [--steps N] [--long-steps N] [--sft-model DIR] [--quick] [--trl-seed N]
                    [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from miles.config import load_config
from miles.run_config import RunConfig
from miles.models.presets import build_tiny_model
from miles.orchestration.driver import run_sft, run_train
from miles.rewards.contract import load_reward
from miles.data.prompts import PromptSource
from miles.rollout.group import long_tail_length

HERE = Path(__file__).resolve().parent
# Run as `python benchmarks/trl.py`, this folder would be first on sys.path and `import trl` would
# import this file; the TRL package is the one meant.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

TRL_VERSION = "1.16.0"  # pyproject's test extra; the settings below are mapped for this release
EXAMPLE = HERE.parent / "examples" / "arithmetic"
LONG_REWARD = f"{HERE / '_answer_first.py'}:answer_first"

MATCHED = [
    "checkpoint: the same SFT (short) or long-format (long) folder, float32 on both sides",
    "prompts and order: the task's train split from run.seed, TRL's dataset unshuffled in miles' order",
    "reward: the same Python function (miles' exact_match, or benchmarks/_answer_first.py)",
    "group size (8), prompts per step, max new tokens, temperature 1.0, no top-k/top-p",
    "learning rate (grpo.toml's 3e-4, constant), AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), "
    "grad clip 1.0, one optimizer step per training step",
    "loss: clipped surrogate, clip range 0.2/0.2, no KL (TRL beta 0), token mean over the batch (TRL loss_type "
    "dapo), advantages normalised within the group",
    "number of training steps; eval: one function (greedy, same held-out problems) on every final checkpoint",
]

UNMATCHED = [
    "zero-variance groups: miles drops them (buffer.filter = nonzero_std, as shipped); TRL keeps them "
    "with zero advantage in the token-mean denominator. So a miles sync step trains fewer samples than "
    "it generates, and a fully_async step draws more prompts until prompts_per_step groups pass; the "
    "figure counts prompts_per_step x samples per step for every contender",
    "group std: miles divides by the population std + 1e-6; TRL by the sample std (n-1) + 1e-4",
    "sampling RNG: miles seeds each sample on its engine, TRL draws from one torch generator, so the "
    "sampled tokens differ from the first step",
    "generation dtype and kernels: miles' built-in engine (float32, its own KV cache and batching) vs "
    "transformers.generate() on the training model",
    "threads: TRL one process with every core; miles sync engine and trainer each with every core, "
    "taking turns (colocated; the engines keep their memory meanwhile, placement.release_memory = []); "
    "miles fully_async half the cores each",
    "fully_async trains groups in the order they finish (staleness <= --max-staleness, TIS truncate "
    "on the stale ones); TRL and miles sync train each step's prompts on the current policy",
    "micro-batches: miles lays each step out as trainer.pack_sequences = 'auto' chooses: packed rows "
    "(sequences end to end, each attending to itself) when they feed the model fewer tokens, else padded "
    "rows computing each prompt once per micro-batch for the samples continuing it (trainer.share_prompts), "
    "either within trainer.max_tokens_per_micro_batch (8192) tokens, longest first (the same gradient); TRL trains a "
    "step's samples as one batch padded to its longest completion (per_device_train_batch_size = the "
    "step's samples), every sample with its prompt",
    "old-policy logprobs: miles takes the engine's (its rollout logprobs, the trainer's within about 1e-6 "
    "here: train/rollout_logprob_abs_diff); TRL with one iteration per batch uses the detached current "
    "logprobs (ratio 1)",
]


def ncores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2


def workload(name: str, args, sft_model: str, long_model: str) -> dict:
    """The settings both sides share for one workload."""
    if name == "short":
        return {"name": "short", "model": sft_model, "steps": args.steps, "prompts_per_step": args.prompts_per_step,
                "samples": 8, "max_new_tokens": 6, "reward": "exact_match", "lr": 3e-4, "eval_new_tokens": 6,
                "filter": args.miles_filter}
    return {"name": "long", "model": long_model, "steps": args.long_steps, "prompts_per_step": args.long_prompts,
            "samples": 8, "max_new_tokens": args.long_max_new_tokens, "reward": LONG_REWARD, "lr": 3e-4,
            "eval_new_tokens": 6, "filter": args.miles_filter}


def reward_fn(spec: str):
    """The workload's `(response, label) -> float`, loaded the way miles loads it."""
    return load_reward(spec).fn


def example_task(model: str):
    """grpo.toml's rollout.task, as a run from `model` reads it."""
    return load_config(RunConfig, EXAMPLE / "grpo.toml", {"model.path": model}).rollout.task


def train_prompts(model: str, seed: int, n: int):
    """The prompts miles' sync loop takes, in its order (the task's train split from run.seed)."""
    return PromptSource(example_task(model), "train", seed).take(n)


def eval_prompts(model: str, seed: int, n: int):
    """`n` distinct held-out problems of the task's eval split, in the order the seed draws them (the
    split draws with replacement, and a repeated problem would only weigh twice); fewer when the split
    holds fewer."""
    source, seen, out = PromptSource(example_task(model), "eval", seed), set(), []
    for _ in range(50):
        for p in source.take(n):
            if p.text not in seen:
                seen.add(p.text)
                out.append(p)
                if len(out) == n:
                    return out
    return out


def evaluate(model_dir: str, prompts, reward, max_new_tokens: int, batch: int = 64, device: str = "cpu") -> float:
    """Greedy accuracy of a checkpoint on `prompts`: the one eval function for every contender."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    scores = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        enc = tok([p.text for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        scores += [reward(t, p.label) for t, p in zip(texts, chunk)]
    return sum(scores) / len(scores)


def long_format_sft(sft_model: str, out: Path, steps: int, max_new_tokens: int, seed: int) -> str:
    """Teach the long format on top of the SFT checkpoint: answer, then `=answer` repeated a Pareto
    number of times, then EOS. Loss on response tokens only, with the answer weighing as much as
    everything after it: the repeats are copies (easy tokens, many of them), and under a plain token
    mean they drown the arithmetic the answer needs. Returns the new checkpoint's folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sft_model)
    model = AutoModelForCausalLM.from_pretrained(sft_model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    demos = train_prompts(sft_model, seed + 7, steps * 16)  # a stream apart from the GRPO prompts
    for step in range(steps):
        rows, kinds = [], []  # kinds per token: 0 prompt/pad, 1 the answer, 2 what follows it
        for j, p in enumerate(demos[step * 16:(step + 1) * 16]):
            length = min(max_new_tokens, long_tail_length(4 * max_new_tokens, seed * 1_000_003 + step * 16 + j))
            repeats = max(0, (length - len(p.label)) // (len(p.label) + 1))
            prompt = tok(p.text, add_special_tokens=False).input_ids
            answer = tok(p.label, add_special_tokens=False).input_ids
            rest = tok(f"={p.label}" * repeats, add_special_tokens=False).input_ids if repeats else []
            response = (answer + rest)[:max_new_tokens - 1] + [tok.eos_token_id]
            rows.append(prompt + response)
            kinds.append([0] * len(prompt) + [1] * len(answer) + [2] * (len(response) - len(answer)))
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
        kind = torch.tensor([k + [0] * (width - len(k)) for k in kinds])
        mask = torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None]
        logits = model(input_ids=ids, attention_mask=mask.long()).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        target = kind[:, 1:]
        loss = sum(nll[target == k].mean() for k in (1, 2) if (target == k).any())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 20 == 0 or step == steps - 1:
            answer_nll = nll[target == 1].mean().item()
            print(f"[bench trl] long-format SFT step {step + 1}/{steps}: answer nll {answer_nll:.3f}, "
                  f"total {loss.item():.3f}", file=sys.stderr, flush=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def run_trl(w: dict, out: Path, seed: int, device: str = "cpu", sampling_seed: int | None = None) -> dict:
    """TRL's GRPOTrainer on the workload; loop time = the sum of its training steps. The prompts are
    `seed`'s; TRL's own seed (its sampling) is `sampling_seed`, `seed` unless given."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    reward = reward_fn(w["reward"])

    def workload_reward(completions, label, **_):
        return [reward(c, lab) for c, lab in zip(completions, label)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps: list[float] = []

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.steps.append(time.perf_counter() - self.t0)

    prompts = train_prompts(w["model"], seed, w["steps"] * w["prompts_per_step"])
    data = Dataset.from_list([{"prompt": p.text, "label": p.label} for p in prompts])
    torch.set_num_threads(ncores())
    tok = AutoTokenizer.from_pretrained(w["model"])
    model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=torch.float32)
    n = w["prompts_per_step"] * w["samples"]
    cfg = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=device == "cpu", bf16=device == "cuda",
        seed=seed if sampling_seed is None else sampling_seed, max_steps=w["steps"],
        per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=w["samples"],
        max_completion_length=w["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=w["lr"], lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1,
        shuffle_dataset=False, logging_steps=1, save_strategy="no", report_to="none", disable_dropout=True,
        dataloader_num_workers=0)
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=[workload_reward], args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[clock])
    gen_s: list[float] = []
    inner = trainer._generate_and_score_completions

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            gen_s.append(time.perf_counter() - t)

    trainer._generate_and_score_completions = timed
    trainer.train()
    final = out / "trl" / "final"
    trainer.save_model(str(final))
    tok.save_pretrained(final)
    logs = [r for r in trainer.state.log_history if "completions/mean_length" in r]
    loop_s = sum(clock.steps)
    return {"loop_s": loop_s, "samples_per_s": n * w["steps"] / loop_s, "step_s": clock.steps,
            "generate_and_score_s_mean": statistics.fmean(gen_s) if gen_s else None,
            "train_s_mean": (loop_s - sum(gen_s)) / max(len(clock.steps), 1),
            "response_len_mean": statistics.fmean(r["completions/mean_length"] for r in logs) if logs else None,
            "reward_mean": statistics.fmean(r.get("reward", 0.0) for r in logs) if logs else None,
            "model": str(final)}


def miles_overrides(w: dict, out: Path, schedule: str, seed: int, max_staleness: int, device: str = "cpu") -> dict:
    """grpo.toml's overrides for the workload, schedule and device."""
    pps, cores = w["prompts_per_step"], ncores()
    over = {"model.path": w["model"], "run.output_dir": str(out / "miles"), "run.name": f"{w['name']}-{schedule}",
            "run.seed": str(seed), "loop.num_steps": str(w["steps"]), "loop.save_every": "0",
            "rollout.prompts_per_step": str(pps), "rollout.n_samples_per_prompt": str(w["samples"]),
            "rollout.max_new_tokens": str(w["max_new_tokens"]), "rollout.reward": w["reward"],
            "trainer.lr": str(w["lr"]), "buffer.filter": w["filter"], "eval.every_steps": "0", "eval.num_prompts": "8",
            "eval.max_new_tokens": str(w["eval_new_tokens"]), "metrics.progress": "plain",
            "trainer.device": device, "rollout.engine.device": device}
    if device == "cuda":
        # bf16 compute as TRL's bf16 autocast; a context the static KV cache can give every row, so the
        # engine decodes on its fast path (EngineConfig.fast_decode = auto).
        over.update({"rollout.engine.dtype": "bfloat16", "trainer.param_dtype": "bfloat16",
                     "rollout.engine.context_length": str(w["max_new_tokens"] + 256)})
    if schedule == "sync":
        # Every core to each side in turn; the engines keep their memory while the trainer works, as
        # TRL keeps its one model (this machine holds both, and releasing writes the weights to a file).
        over.update({"placement.mode": "colocated", "rollout.engine.num_threads": str(cores),
                     "trainer.num_threads": str(cores), "placement.release_memory": ""})
    else:
        half = str(max(1, cores // 2))
        over.update({"loop.schedule": "fully_async", "placement.mode": "disaggregated",
                     "rollout.engine.num_threads": half, "trainer.num_threads": half,
                     "buffer.max_staleness": str(max_staleness), "buffer.max_inflight_groups": str(pps),
                     "buffer.capacity": str(pps), "trainer.algorithm.tis_mode": "truncate"})
    return over


def run_miles(w: dict, out: Path, schedule: str, seed: int, max_staleness: int, device: str = "cpu") -> dict:
    """`miles train` on grpo.toml with the workload's settings; loop time = sum of step times less eval."""
    pps = w["prompts_per_step"]
    over = miles_overrides(w, out, schedule, seed, max_staleness, device)
    summary = run_train(load_config(RunConfig, EXAMPLE / "grpo.toml", over))
    recs = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["step"] > 0 and "perf/step_s" in r]
    loop = [r["perf/step_s"] - r.get("perf/eval_s", 0.0) for r in steps]
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in steps)  # noqa: E731
    loop_s = sum(loop)
    return {"loop_s": loop_s, "samples_per_s": pps * w["samples"] * len(steps) / loop_s, "step_s": loop,
            "rollout_s_mean": mean("perf/rollout_s"), "train_s_mean": mean("perf/train_s"),
            "sync_s_mean": mean("perf/sync_s"), "wait_data_s_mean": mean("perf/wait_data_s"),
            "response_len_mean": mean("rollout/response_len_mean"), "reward_mean": mean("rollout/reward_mean"),
            "samples_trained": sum(r.get("buffer/samples_trained", 0) for r in steps),
            "ledger": summary["ledger"], "model": summary["final_checkpoint"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench trl", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="short,long", help="comma-separated: short, long")
    p.add_argument("--steps", type=int, default=100, help="training steps of the short workload (grpo.toml's)")
    p.add_argument("--prompts-per-step", type=int, default=32, help="prompts per step of the short workload "
                   "(grpo.toml's)")
    p.add_argument("--long-steps", type=int, default=10, help="training steps of the long workload")
    p.add_argument("--long-prompts", type=int, default=16, help="prompts per step of the long workload")
    p.add_argument("--long-max-new-tokens", type=int, default=256)
    p.add_argument("--long-sft-steps", type=int, default=150, help="supervised steps teaching the long format")
    p.add_argument("--sft-model", default="", help="reuse this SFT checkpoint (else examples/arithmetic/sft.toml)")
    p.add_argument("--long-model", default="", help="reuse a long-format checkpoint (else built from the SFT one)")
    p.add_argument("--sft-steps", type=int, default=1500, help="SFT steps when building the checkpoint")
    p.add_argument("--eval-prompts", type=int, default=1000,
                   help="distinct held-out problems every final checkpoint is scored on (the arithmetic "
                        "task's eval split holds about 1040)")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--miles-filter", default="nonzero_std",
                   help="miles' buffer.filter (as shipped: nonzero_std; none keeps zero-variance groups, as TRL does)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-seed", type=int, default=None,
                   help="TRL's sampling seed (default: --seed); the prompts stay --seed's, so runs differing "
                        "only here show how far TRL lands from itself")
    p.add_argument("--only", default="", help="comma-separated contenders: trl, miles_sync, miles_fully_async")
    p.add_argument("--quick", action="store_true",
                   help="smoke-sized: tiny-qwen3 with 2 SFT steps unless --sft-model, 1 step of 4 prompts, "
                        "16 new tokens in the long workload, 8 eval prompts, --miles-filter none (a model "
                        "that never answers right gives only zero-variance groups, and fully_async would "
                        "wait for a group that passes)")
    p.add_argument("--out", default="", help="working folder (default: a temporary one)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where every contender generates and trains (cuda: bf16 on both sides)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.long_steps = min(args.steps, 1), min(args.long_steps, 1)
        args.prompts_per_step, args.long_prompts = 4, 4
        args.long_max_new_tokens, args.long_sft_steps, args.eval_prompts = 16, 2, 8
        args.miles_filter = "none"
    names = [n for n in args.workloads.split(",") if n]
    if set(names) - {"short", "long"}:
        p.error(f"--workloads: unknown {sorted(set(names) - {'short', 'long'})}; choose from short, long")
    contenders = [c for c in args.only.split(",") if c] or ["trl", "miles_sync", "miles_fully_async"]
    if set(contenders) - {"trl", "miles_sync", "miles_fully_async"}:
        p.error("--only: choose from trl, miles_sync, miles_fully_async")
    if args.miles_filter not in ("nonzero_std", "none"):
        p.error("--miles-filter: choose nonzero_std (as shipped) or none")
    if min(args.steps, args.long_steps) < 1 or args.long_max_new_tokens < 8:
        p.error("--steps and --long-steps must be >= 1, --long-max-new-tokens >= 8")

    try:
        found = version("trl")
    except PackageNotFoundError:
        sys.exit(f"miles bench trl: TRL is not installed; pip install 'miles[test]' (pins trl=={TRL_VERSION})")
    if found != TRL_VERSION:
        sys.exit(f"miles bench trl: found trl {found}, the benchmark maps its settings for trl {TRL_VERSION}; "
                 f"pip install trl=={TRL_VERSION}")

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("miles bench trl: --device cuda but torch sees no CUDA device; leave --device at cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    out = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    import ray


    t_start = time.perf_counter()
    from miles.orchestration.ray_cluster import ensure_ray
    from miles.run_sections import RayConfig

    ensure_ray(RayConfig(num_cpus=ncores()))  # a cluster of its own, whatever else runs here
    sft_model = args.sft_model
    if not sft_model:
        base = build_tiny_model("tiny-qwen3" if args.quick else "small-qwen3", out / "base")
        sft_model = str(out / "sft-model")
        run_sft(load_config(RunConfig, EXAMPLE / "sft.toml", {
            "model.path": str(base), "sft.out": sft_model, "sft.steps": str(2 if args.quick else args.sft_steps),
            "metrics.progress": "plain"}))
    long_model = args.long_model
    if "long" in names and not long_model:
        long_model = long_format_sft(sft_model, out / "long-model", args.long_sft_steps, args.long_max_new_tokens,
                                     args.seed)
    held_out = eval_prompts(sft_model, args.seed, args.eval_prompts)
    line: dict = {}
    for name in names:
        w = workload(name, args, sft_model, long_model)
        start_accuracy = evaluate(w["model"], held_out, reward_fn(w["reward"]), w["eval_new_tokens"],
                                  device=args.device)
        runs: dict[str, dict] = {}
        for c in contenders:
            t = time.perf_counter()
            runs[c] = (run_trl(w, out, args.seed, args.device, args.trl_seed) if c == "trl" else
                       run_miles(w, out, c.removeprefix("miles_"), args.seed, args.max_staleness, args.device))
            runs[c]["wall_s"] = time.perf_counter() - t
            runs[c]["eval_accuracy"] = evaluate(runs[c]["model"], held_out, reward_fn(w["reward"]),
                                                w["eval_new_tokens"], device=args.device)
            shown = {k: v for k, v in runs[c].items() if k not in ("step_s", "ledger")}
            print(f"[bench trl] {name} {c}: {json.dumps(shown)}", file=sys.stderr, flush=True)
        rate = lambda c: runs[c]["samples_per_s"] if c in runs else None  # noqa: E731
        acc = lambda c: runs[c]["eval_accuracy"] if c in runs else None  # noqa: E731
        # miles' best schedule is the faster one of those that ran; its eval is the one set against TRL's.
        timed = [c for c in ("miles_sync", "miles_fully_async") if rate(c)]
        miles_best = max(timed, key=rate) if timed else None
        line[name] = {
            "trl_samples_per_s": rate("trl"), "miles_sync_samples_per_s": rate("miles_sync"),
            "miles_fully_async_samples_per_s": rate("miles_fully_async"),
            "ratio": rate("miles_fully_async") / rate("trl") if rate("miles_fully_async") and rate("trl") else None,
            "sync_ratio": rate("miles_sync") / rate("trl") if rate("miles_sync") and rate("trl") else None,
            "best_schedule": miles_best and miles_best.removeprefix("miles_"),
            "best_ratio": rate(miles_best) / rate("trl") if miles_best and rate("trl") else None,
            "trl_eval_accuracy": acc("trl"), "miles_eval_accuracy": acc(miles_best),
            "miles_sync_eval_accuracy": acc("miles_sync"), "start_eval_accuracy": start_accuracy,
            "eval_gap_points": 100 * (acc("trl") - acc(miles_best)) if acc("trl") is not None and
            acc(miles_best) is not None else None,
            "settings": {k: v for k, v in w.items() if k != "model"},
            "runs": {c: {k: v for k, v in r.items() if k != "model"} for c, r in runs.items()}}
    ray.shutdown()
    unmatched = UNMATCHED if args.miles_filter == "nonzero_std" else UNMATCHED[1:]
    matched = MATCHED if args.miles_filter == "nonzero_std" else [
        *MATCHED, "zero-variance groups: kept and trained on both sides (--miles-filter none)"]
    if args.device == "cuda":
        matched = [m.replace("float32 on both sides", "float32 master weights and bf16 compute on both sides")
                   for m in matched]
        unmatched = [u.replace("miles' built-in engine (float32, its own KV cache and batching)",
                               "miles' built-in engine (bf16, static KV cache, CUDA graphs, continuous batching)")
                     for u in unmatched]
    line.update({"matched_settings": matched, "unmatched_settings": unmatched, "trl_version": TRL_VERSION,
                 "eval_prompts": len(held_out),
                 "trl_seed": args.seed if args.trl_seed is None else args.trl_seed, "device": args.device,
                 "cores": ncores(), "sft_model": sft_model, "long_model": long_model or None,
                 "wall_s": time.perf_counter() - t_start})
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
