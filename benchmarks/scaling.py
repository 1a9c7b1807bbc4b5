"""`miles bench scaling`: how cost grows. Each curve is measured at several sizes and fitted with a line,
y = fixed + per_unit * x (least squares), so a size not measured can be estimated and the fixed part
(what a step or a version costs however small) is separated from the part that grows.

Curves (one JSON line each, then a summary line with every fit):
  rollout_concurrency  one built-in engine (its own process, one torch thread), B requests of distinct
                       prompts sent at once, every one asking for the same number of new tokens (EOS
                       ignored); y = engine busy seconds per decode step (its own counters, prefill
                       included; the median of --rounds runs), x = B. A decode step costs a fixed
                       part (every weight read once, scheduling, sampling set-up) plus a part per
                       running row, so step time is what a line fits; tokens/s = B / step time is
                       not a line (it levels off at 1 / per_unit), and is reported beside the points
                       with that limit as `tokens_per_s_limit`.
  rollout_context      the same engine, a fixed batch, prompts of growing length; y = busy seconds per
                       decode step (the prefill's share included), x = prompt tokens. The tiny model's
                       position limit is raised to hold the longest prompt (RoPE: nothing is learnt per
                       position).
  sync_<transport>     broadcast, p2p, disk_delta: one whole push (buckets, engine staging, commit) of a
                       Qwen3 model grown by layers at a fixed width, each size served by engines of its
                       own; y = seconds (median of --repeats), x = MiB of bf16 weights. The intercept is
                       the fixed cost of a version. Before each disk_delta push the fp32 master weights
                       take a sign step of 1e-6 (an AdamW step's size at lr 1e-6), so every push is a
                       real delta; its density is reported.
  train_tokens         the FSDP2 trainer on one rank (tiny-qwen3, GRPO loss), batches of growing
                       size; y = seconds per step (median), x = tokens per step.
  async_speedup        a SIMULATION with real sleeps, not a training run (a real fully_async run per
                       point would take tens of minutes): the real DataBuffer between a producer thread
                       that takes rollout_s to make a step's groups and a trainer loop that takes
                       train_s per step, buffer settings from `bench staleness`'s run-ahead at
                       --max-staleness; sync runs the same sleeps in turn. Points are [rollout_s /
                       train_s, sync wall / fully_async wall]. Perfect overlap gives speedup =
                       1 + min(ratio, 1 / ratio), a line in the overlap min(ratio, 1 / ratio), which is
                       therefore the fit's x (fixed 1 and per_unit 1 are the ideal; less is hand-off
                       and backpressure cost).

    miles bench scaling [--quick] [--max-concurrency 512] [--sync-mib 16,64,256,1024] [--only rollout,sync,train,async]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from miles.buffer.data_buffer import BufferClosed, BufferConfig, DataBuffer
from miles.buffer.types import Group, Sample
from miles.models.loading import load_tokenizer
from miles.models.presets import build_tiny_model, train_tokenizer
from miles.net import free_port
from miles.data.prompts import PromptSource, TaskConfig
from miles.engine.process import EngineProcess
from miles.sync.transports import get_transport
from miles.trainer.config import TrainerConfig
from miles.trainer.types import BatchTotals

from benchmarks.rollout import _counters, _flush, run_miles_grpo
from benchmarks.staleness import run_ahead
from benchmarks.sync import named_bf16, time_push
from benchmarks.train import make_batch

CURVES = ("rollout", "sync", "train", "async")
TRANSPORTS = ("broadcast", "p2p", "disk_delta")
TOKEN = "bench-scaling"


def fit_line(points: list[list[float]] | list[tuple[float, float]], unit: str) -> dict:
    """Least-squares y = fixed + per_unit * x over (x, y) points, with r2 (1 on a perfect line)."""
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        raise ValueError(f"a line needs points at two or more distinct x, got {points}: measure more sizes")
    per_unit, fixed = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    my = statistics.fmean(y for _, y in points)
    ss_res = sum((y - fixed - per_unit * x) ** 2 for x, y in points)
    ss_tot = sum((y - my) ** 2 for _, y in points)
    # A flat series leaves no spread to explain, and its flat line passes through every point.
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return {"fixed": fixed, "per_unit": per_unit, "unit": unit, "r2": r2}


def curve(name: str, points: list, unit: str, fit_points: list | None = None, **extra) -> dict:
    """One curve's line: its points, their fit (on `fit_points` where the fitted x is not the plotted
    one), and whatever else the curve reports."""
    fit = {k: _sig(v) for k, v in fit_line(fit_points or points, unit).items()}
    return {"curve": name, "points": [[_sig(x), _sig(y)] for x, y in points], "fit": fit, **extra}


def _sig(v):
    """Six significant digits: what a timing on a shared machine can carry, and a line people can read."""
    return float(f"{v:.6g}") if isinstance(v, float) else v


def summary(curves: list[dict], **extra) -> dict:
    """The last line: every curve's fit by name."""
    return {"summary": "scaling", "fits": {c["curve"]: c["fit"] for c in curves}, **extra}


def _emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


# -- rollout -------------------------------------------------------------------------------------------

def _random_prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    # Distinct random ids: the engine computes identical prompts once and caches shared prefixes, and
    # neither may make a bigger batch look cheaper.
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(count)]


def _engine_run(url: str, prompts: list[list[int]], new_tokens: int, seed: int) -> dict:
    """Every prompt sent at once: the engine's busy seconds per decode step, its decode steps, and
    tokens per second of wall time."""
    _flush(url)
    before = _counters(url)
    wall, tokens = asyncio.run(run_miles_grpo(url, prompts, 1, [new_tokens] * len(prompts), seed))
    after = _counters(url)
    steps = after["decode_forwards"] - before["decode_forwards"]
    busy = after["busy_s"] - before["busy_s"]
    return {"step_s": busy / max(steps, 1), "tokens_per_s": tokens / wall, "decode_steps": steps}


def _measure(url: str, a, vocab: int, shapes: list[tuple[int, int]], seed: int) -> list[dict]:
    """Each (requests, prompt tokens) shape --rounds times, in alternating order so a neighbour's load
    spreads over every shape alike; per shape the median step time and tokens/s, and its decode steps."""
    rng = random.Random(seed)
    runs: list[list[dict]] = [[] for _ in shapes]
    for r in range(a.rounds):
        order = list(enumerate(shapes))
        for i, (count, length) in order if r % 2 == 0 else order[::-1]:
            runs[i].append(_engine_run(url, _random_prompts(rng, count, length, vocab), a.new_tokens,
                                       seed + 1000 * r + i))
            print(f"[bench scaling] rollout {count} x {length} tokens: {runs[i][-1]}", file=sys.stderr, flush=True)
    return [{"step_s": statistics.median(x["step_s"] for x in rs),
             "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in rs), 1),
             "decode_steps": max(x["decode_steps"] for x in rs)} for rs in runs]


def rollout_curves(url: str, a, vocab: int) -> list[dict]:
    _engine_run(url, _random_prompts(random.Random(a.seed), 2, 8, vocab), 4, a.seed)  # warm-up
    sizes, b = [], 1
    while b <= a.max_concurrency:
        sizes.append(b)
        b *= 2
    got = _measure(url, a, vocab, [(b, a.prompt_tokens) for b in sizes], a.seed)
    conc = curve("rollout_concurrency", [(b, g["step_s"]) for b, g in zip(sizes, got)], "sequence",
                 y="engine busy s per decode step", tokens_per_s=[g["tokens_per_s"] for g in got],
                 decode_steps=[g["decode_steps"] for g in got], new_tokens=a.new_tokens,
                 prompt_tokens=a.prompt_tokens, rounds=a.rounds)
    conc["tokens_per_s_limit"] = _sig(1 / conc["fit"]["per_unit"]) if conc["fit"]["per_unit"] > 0 else None
    got = _measure(url, a, vocab, [(a.context_batch, n) for n in a.context], a.seed + 1)
    ctx = curve("rollout_context", [(n, g["step_s"]) for n, g in zip(a.context, got)], "prompt token",
                y="engine busy s per decode step (prefill included)", tokens_per_s=[g["tokens_per_s"] for g in got],
                batch=a.context_batch, new_tokens=a.new_tokens, rounds=a.rounds)
    return [conc, ctx]


# -- sync ----------------------------------------------------------------------------------------------

def build_sized(target_mib: float, width: int, out_dir: str, tokenizer):
    """A Qwen3 model of about `target_mib` MiB of bf16 weights, grown by layers at `width`, saved as a
    bf16 checkpoint (the run's starting point, which disk_delta's engines copy); returns the fp32
    masters. Fixed width keeps tensors per MiB constant, as in a model family grown by depth."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    heads = max(1, width // 64)
    shape = dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=3 * width,
                 num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64)
    per_layer = 2 * (2 * width * heads * 64 + 2 * width * max(1, heads // 2) * 64 + 3 * width * 3 * width)
    embed = 2 * len(tokenizer) * width
    layers = max(1, round((target_mib * 2**20 - embed) / per_layer))
    config = Qwen3Config(**shape, num_hidden_layers=layers, max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.eos_token_id, dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # masters start where the bf16 checkpoint is
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.float()
    tokenizer.save_pretrained(out_dir)
    return model


def sign_step(model, size: float, seed: int) -> None:
    """An optimizer step's change without the optimizer: every master weight moves by `size`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randint(0, 2, p.shape, generator=g).float().mul_(2 * size).sub_(size))


class SizedFleet:
    """One model size: its fp32 masters, its checkpoint, its engines and one sender per transport."""

    def __init__(self, target_mib: float, width: int, root: str, tokenizer):
        self.dir = os.path.join(root, f"sync-{target_mib:g}")
        self.model = build_sized(target_mib, width, self.dir, tokenizer)
        self.named = named_bf16(self.model)
        self.mib = sum(t.numel() * t.element_size() for _, t in self.named) / 2**20
        self.engines, self.senders = [], {}
        self.version = 0

    def start(self, engines: int) -> None:
        for _ in range(engines):
            self.engines.append(EngineProcess(self.dir, admin_token=TOKEN, startup_timeout_s=600,
                                              extra_args=["--dtype", "bfloat16", "--num-threads", "1"]))

    def connect(self, bucket_bytes: int) -> None:
        urls = [e.url for e in self.engines]
        self.senders = {
            "broadcast": get_transport("broadcast", admin_token=TOKEN, timeout_s=600),
            "p2p": get_transport("p2p", admin_token=TOKEN, timeout_s=600, buffer_bytes=bucket_bytes),
            "disk_delta": get_transport("disk_delta", admin_token=TOKEN, timeout_s=600,
                                        delta_dir=os.path.join(self.dir, "deltas"), base_path=self.dir,
                                        local_dir=os.path.join(self.dir, "local"))}
        for s in self.senders.values():
            s.connect(urls)

    def push(self, transport: str, bucket_bytes: int) -> float:
        self.version += 1
        if transport == "disk_delta":
            sign_step(self.model, 1e-6, self.version)
            self.named = named_bf16(self.model)
        return time_push(self.senders[transport], self.named, self.version, bucket_bytes)

    def stop(self) -> None:
        for s in self.senders.values():
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - a failed close must not keep engines alive
                print(f"[bench scaling] closing a sender: {e}", file=sys.stderr)
        for e in self.engines:
            e.stop()


def sync_curves(fleets: list[SizedFleet], a) -> list[dict]:
    bucket_bytes = a.bucket_mb << 20
    times: dict[str, list[list[float]]] = {t: [[] for _ in fleets] for t in TRANSPORTS}
    density = []
    for r in range(1 + a.repeats):  # one warm-up round: receive buffers grow and get their pages
        for fleet in fleets if r % 2 == 0 else fleets[::-1]:
            for t in TRANSPORTS:
                s = fleet.push(t, bucket_bytes)
                if r:
                    times[t][fleets.index(fleet)].append(s)
                if t == "disk_delta" and r:
                    st = fleet.senders[t].last_stats
                    density.append(st["delta/changed_bytes"] / st["delta/full_bytes"])
        print(f"[bench scaling] sync round {r} done", file=sys.stderr, flush=True)
    out = []
    for t in TRANSPORTS:
        points = [(round(f.mib, 2), statistics.median(times[t][i])) for i, f in enumerate(fleets)]
        extra = {"engines": len(fleets[0].engines), "repeats": a.repeats, "bucket_mb": a.bucket_mb,
                 "width": a.sync_width}
        if t == "disk_delta":
            extra["delta_density_mean"] = _sig(sum(density) / len(density))
        line = curve(f"sync_{t}", points, "MiB", y="s per push", **extra)
        line["fixed_cost_per_version_s"] = line["fit"]["fixed"]
        out.append(line)
    return out


# -- train ---------------------------------------------------------------------------------------------

def train_curve(model_dir: str, a) -> dict:
    import torch

    from miles.trainer.trainer import Trainer  # imports torch

    trainer = Trainer(TrainerConfig(lr=1e-5), model_dir, 0, 1, "127.0.0.1", free_port())
    torch.set_num_threads(1)
    points = []
    for n in a.train_batches:
        batch = make_batch(300, n, seed=n)
        totals = BatchTotals.of(batch)
        secs = []
        for i in range(1 + a.train_steps):  # the first step of a shape is set-up, not its cost
            t0 = time.perf_counter()
            trainer.train_step(batch, totals)
            if i:
                secs.append(time.perf_counter() - t0)
        points.append((sum(len(s.tokens) for s in batch), statistics.median(secs)))
        print(f"[bench scaling] train {n} sequences: {points[-1]}", file=sys.stderr, flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return curve("train_tokens", points, "token", y="s per step", batches=a.train_batches, steps=a.train_steps)


# -- async ---------------------------------------------------------------------------------------------

def _simulated_fully_async(rollout_s: float, train_s: float, pps: int, steps: int, max_staleness: int) -> tuple:
    """Wall seconds of `steps` trainer steps fed through the real DataBuffer by a producer thread that
    makes one group every rollout_s / pps seconds; and the groups dropped as too stale."""
    over = run_ahead(max_staleness, pps)
    buf = DataBuffer(BufferConfig(max_staleness=max_staleness, capacity=int(over["buffer.capacity"]),
                                  max_inflight_groups=int(over["buffer.max_inflight_groups"]), filter="none"),
                     PromptSource(TaskConfig(), "train", seed=0))

    def produce():
        try:
            while True:
                prompt = buf.admit()
                version = buf.weight_version
                time.sleep(rollout_s / pps)
                buf.put(Group(samples=[Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.1],
                                              loss_mask=[1], weight_versions=[version], prompt_index=prompt.index)],
                              prompt_index=prompt.index))
        except BufferClosed:
            pass

    producer = threading.Thread(target=produce, daemon=True)
    t0 = time.perf_counter()
    producer.start()
    for v in range(steps):
        buf.get(pps, timeout=600)
        time.sleep(train_s)
        buf.set_policy_version(v + 1)
        buf.set_weight_version(v + 1)  # the push after the step
    wall = time.perf_counter() - t0
    dropped = buf.metrics()["buffer/dropped_stale"]
    buf.close()
    producer.join(10)
    return wall, dropped


def async_curve(a) -> dict:
    points, overlaps, dropped = [], [], []
    for ratio in a.async_ratios:
        rollout_s, train_s = ratio * a.async_train_s, a.async_train_s
        t0 = time.perf_counter()
        for _ in range(a.async_steps):
            for _ in range(a.async_pps):
                time.sleep(rollout_s / a.async_pps)  # the same sleeps as the producer's, in turn
            time.sleep(train_s)
        sync_wall = time.perf_counter() - t0
        async_wall, drop = _simulated_fully_async(rollout_s, train_s, a.async_pps, a.async_steps, a.max_staleness)
        points.append((ratio, sync_wall / async_wall))
        overlaps.append(min(ratio, 1 / ratio))
        dropped.append(drop)
        print(f"[bench scaling] async ratio {ratio}: sync {sync_wall:.2f}s fully_async {async_wall:.2f}s",
              file=sys.stderr, flush=True)
    return curve("async_speedup", points, "overlap", fit_points=list(zip(overlaps, (y for _, y in points))),
                 method="simulation (real DataBuffer, real sleeps)", x="rollout_s / train_s",
                 fit_x="overlap = min(ratio, 1 / ratio)", y="sync wall / fully_async wall",
                 ideal={"fixed": 1.0, "per_unit": 1.0}, dropped_stale=dropped, train_s=a.async_train_s,
                 steps=a.async_steps, prompts_per_step=a.async_pps, max_staleness=a.max_staleness)


# -- main ----------------------------------------------------------------------------------------------

def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


QUICK = {"max_concurrency": 8, "new_tokens": 8, "context": [16, 64, 128], "context_batch": 4, "rounds": 2,
         "sync_mib": [2.0, 4.0, 8.0], "sync_width": 256, "sync_engines": 1, "repeats": 3, "bucket_mb": 64,
         "train_batches": [2, 4, 8], "train_steps": 3,
         "async_ratios": [0.5, 1.0, 2.0], "async_train_s": 0.1, "async_steps": 5, "async_pps": 4}


def plot(outputs: list[str], out_dir: str) -> list[Path]:
    """One PNG per curve from saved outputs of this benchmark (its stdout, one file per run): each run's
    points and its fitted line, on linear axes (a line stays a line). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [[json.loads(line) for line in Path(f).read_text().splitlines() if line.startswith('{"curve"')]
            for f in outputs]
    names = list(dict.fromkeys(c["curve"] for lines in runs for c in lines))
    if not names:
        raise ValueError(f"no curve lines in {', '.join(outputs)}: pass files holding this benchmark's output")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for i, lines in enumerate(runs):
            curve = next((c for c in lines if c["curve"] == name), None)
            if curve is None:
                continue
            xs, ys = [p[0] for p in curve["points"]], [p[1] for p in curve["points"]]
            fit = curve["fit"]
            dots = ax.plot(xs, ys, "o", label=f"run {i + 1}: {fit['fixed']:.3g} + {fit['per_unit']:.3g} x")
            grid = [min(xs) + (max(xs) - min(xs)) * k / 200 for k in range(201)]
            # The speedup is fitted in the overlap min(r, 1/r), not in the ratio the points are drawn at.
            at = (lambda r: min(r, 1 / r)) if name == "async_speedup" else (lambda r: r)
            ax.plot(grid, [fit["fixed"] + fit["per_unit"] * at(x) for x in grid], "-", color=dots[0].get_color())
        ax.set_xlabel(curve.get("x", fit["unit"]))
        ax.set_ylabel(curve["y"])
        ax.set_title(name)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = Path(out_dir) / f"scaling_{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes of every curve (a smoke run, minutes)")
    p.add_argument("--only", default=",".join(CURVES), help=f"comma-separated curves from {', '.join(CURVES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=512, help="largest batch: 1, 2, 4, ... up to this")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens each rollout request generates")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length of the concurrency curve")
    p.add_argument("--context", type=_ints, default=[64, 128, 256, 512, 1024], help="prompt lengths")
    p.add_argument("--context-batch", type=int, default=32, help="requests at once on the context curve")
    p.add_argument("--rounds", type=int, default=3, help="runs of every rollout shape (the median is reported)")
    p.add_argument("--sync-mib", type=_floats, default=[16.0, 64.0, 256.0, 1024.0],
                   help="model sizes in MiB of bf16 weights (the nearest whole number of layers)")
    p.add_argument("--sync-width", type=int, default=512, help="hidden size of the sync models")
    p.add_argument("--sync-engines", type=int, default=1,
                   help="engines each sync model is pushed to (every size's fleet lives for the whole curve: "
                        "two engines per size up to 1 GiB hold more than 24 GiB)")
    p.add_argument("--repeats", type=int, default=3, help="timed pushes per transport and size (median)")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--train-batches", type=_ints, default=[8, 16, 32, 64, 128], help="sequences per step")
    p.add_argument("--train-steps", type=int, default=5, help="timed steps per batch size (median)")
    p.add_argument("--async-ratios", type=_floats, default=[0.25, 0.5, 1.0, 2.0, 4.0], help="rollout_s / train_s")
    p.add_argument("--async-train-s", type=float, default=0.2, help="simulated seconds of a trainer step")
    p.add_argument("--async-steps", type=int, default=20)
    p.add_argument("--async-pps", type=int, default=8, help="groups per step in the simulation")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--plot-from", default="", help="measure nothing: plot the curves of saved outputs of this "
                   "benchmark (comma-separated files, one run each) into --plot-dir")
    p.add_argument("--plot-dir", default="scaling-plots", help="where --plot-from writes one PNG per curve")
    a = p.parse_args(argv)
    if a.quick:
        explicit = {arg.split("=")[0].lstrip("-").replace("-", "_") for arg in (argv or []) if arg.startswith("--")}
        for k, v in QUICK.items():
            if k not in explicit:
                setattr(a, k, v)
    a.only = [c for c in a.only.split(",") if c]
    unknown = set(a.only) - set(CURVES)
    if unknown:
        p.error(f"--only: unknown curves {sorted(unknown)}; choose from {', '.join(CURVES)}")
    for name in ("rounds", "repeats", "train_steps", "async_steps", "async_pps", "sync_engines"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(a.async_ratios) <= 0:
        p.error("--async-ratios must all be above 0 (rollout_s / train_s)")
    if a.max_concurrency < 2:
        p.error("--max-concurrency must be at least 2 (a line needs two batch sizes)")
    for name in ("context", "sync_mib", "train_batches", "async_ratios"):
        if len(set(getattr(a, name))) < 2:
            p.error(f"--{name.replace('_', '-')} needs two or more distinct sizes (a line needs two points)")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.plot_from:
        for path in plot([f for f in a.plot_from.split(",") if f], a.plot_dir):
            print(path)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    curves: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-scaling-") as tmp:
        model_dir = ""
        if "rollout" in a.only or "train" in a.only:
            model_dir = str(build_tiny_model("tiny-qwen3", os.path.join(tmp, "tiny")))
            # Hold the longest prompt plus its completion; RoPE computes any position.
            cfg_path = Path(model_dir) / "config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"],
                                                 max(a.context + [a.prompt_tokens]) + a.new_tokens + 1)
            cfg_path.write_text(json.dumps(cfg))
        fleets: list[SizedFleet] = []
        started = None
        # Engines start while the sync models are built and while each other start (start-up is mostly
        # imports, which overlap); each then idles, using no CPU, until its curve is measured.
        pool = ThreadPoolExecutor(max_workers=1 + len(a.sync_mib))
        try:
            if "rollout" in a.only:
                started = pool.submit(EngineProcess, model_dir, startup_timeout_s=600, extra_args=[
                    "--num-threads", "1", "--max-batch-size", str(max(a.max_concurrency, a.context_batch))])
            if "sync" in a.only:
                tokenizer = train_tokenizer(512, seed=0)  # one for every size: training one takes seconds
                fleets = [SizedFleet(m, a.sync_width, tmp, tokenizer) for m in a.sync_mib]
            jobs = [pool.submit(f.start, a.sync_engines) for f in fleets]
            if started is not None:
                engine = started.result()
                for line in rollout_curves(engine.url, a, len(load_tokenizer(model_dir))):
                    curves.append(line)
                    _emit(line)
                engine.stop()
            for j in jobs:
                j.result()
            for f in fleets:
                f.connect(a.bucket_mb << 20)
            if fleets:
                for line in sync_curves(fleets, a):
                    curves.append(line)
                    _emit(line)
        finally:
            pool.shutdown(wait=True)  # every start has finished or failed: nothing is left to leak
            if started is not None and started.exception() is None:
                started.result().stop()
            for f in fleets:
                f.stop()
        if "train" in a.only:
            curves.append(train_curve(model_dir, a))
            _emit(curves[-1])
    if "async" in a.only:
        curves.append(async_curve(a))
        _emit(curves[-1])
    _emit(summary(curves, quick=a.quick, wall_s=round(time.perf_counter() - t_start, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
