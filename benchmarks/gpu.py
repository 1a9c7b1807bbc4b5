"""`miles bench gpu`: the built-in engine's decode and the trainer's step against their baselines and
the memory floor, on one device (cuda by default; `--device cpu` runs small sizes, CI's smoke).

  * decode: B sequences of a 16-token prompt, each sampled to exactly N new tokens (EOS ignored), by
    transformers' generate() and by the built-in engine (in this process, no HTTP), same model and
    dtype (bf16 on cuda). Per batch: tokens/s of each and their ratio, the engine's time per decode
    step, and the floor: the bytes one decode step must read (every weight once, plus the batch's KV
    at its mean length) over the device-copy bandwidth measured in the same run. The engine decodes on
    its fast path (static KV cache, CUDA graphs on cuda; `--engine eager` for the eager one).
  * breakdown (per batch, fast path): a decode step taken apart at the middle of a generation: the
    whole step, its forward (graph replay on cuda), the same forward eager, sampling, and the eager
    forward's kernel time by kind (attention, matmuls, other) from torch.profiler; what is left of the
    forward once its kernels are counted is launch gaps, what is left of the step is host work.
  * trainer: one optimizer step of miles' trainer (FSDP2, bf16 compute over fp32 master weights)
    against a plain bf16-autocast AdamW loop on the same batch, micro-batches and policy-gradient loss.
The model is Qwen3-0.6B-shaped (random weights, built on the device) unless --model names a directory.

    miles bench gpu [--device cuda] [--only decode,trainer] [--batches 64,256] [--new-tokens 256]
                    [--engine fast|eager]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a device-to-device copy far larger than the cache."""
    import torch

    n = (1 << 30) if device == "cuda" else (1 << 27)
    a, b = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    for _ in range(3):
        b.copy_(a)
    _sync(device)
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    _sync(device)
    return 2 * n * 10 / (time.perf_counter() - t)


def build_model(preset: str, device: str, out: str | None = None) -> str:
    """`preset` written to `out` (default: a new temporary directory), built with `device` as torch's
    default device."""
    import torch

    from miles.models.presets import build_tiny_model

    out = out or tempfile.mkdtemp(prefix=f"miles-bench-gpu-{preset}-")
    with torch.device(device):  # a 0.6B shape initialises in seconds on the GPU
        build_tiny_model(preset, out)
    return out


def decode(model_dir: str, device: str, batches: list[int], new_tokens: int, bandwidth: float,
           engine_mode: str = "fast") -> list[dict]:
    import torch

    from miles.models.loading import load_model
    from miles.engine.config import EngineConfig
    from miles.engine.engine import Engine
    from miles.engine.kv_cache import bytes_per_token
    from miles.engine_api.sampling import SamplingParams

    dtype = "bfloat16" if device == "cuda" else "float32"
    P = 16
    g = torch.Generator().manual_seed(0)
    hf = load_model(model_dir, dtype=dtype, device=device).eval()
    weight_bytes = sum(t.numel() * t.element_size() for t in hf.state_dict().values()
                       if t.data_ptr() != hf.get_input_embeddings().weight.data_ptr() or not hf.config.tie_word_embeddings)
    if hf.config.tie_word_embeddings:
        weight_bytes += hf.get_input_embeddings().weight.numel() * hf.get_input_embeddings().weight.element_size()
    per_token = bytes_per_token(hf)

    def hf_run(B: int, n: int) -> float:
        ids = torch.randint(5, 300, (B, P), generator=g).to(device)
        _sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=True,
                        top_k=0, temperature=1.0, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t

    rows = []
    for B in batches:
        hf_run(B, 4)  # warm-up
        hf_s = hf_run(B, new_tokens)
        rows.append({"batch": B, "new_tokens": new_tokens, "hf_tokens_per_s": round(B * new_tokens / hf_s, 1)})
    hf = None  # frees the baseline before the engine loads its own copy
    if device == "cuda":
        torch.cuda.empty_cache()
    engine = Engine(_engine_config(model_dir, device, dtype, max(batches), P + new_tokens, engine_mode))
    try:
        def engine_run(B: int, n: int) -> tuple[float, int]:
            prompts = torch.randint(5, 300, (B, P), generator=g).tolist()
            before = engine.stats["decode_forwards"]
            requests = [engine.make_request(p, SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True,
                                                              seed=i)) for i, p in enumerate(prompts)]
            engine.pause("in_place")  # the whole batch is admitted in one prefill, then decoded together
            t = time.perf_counter()
            futures = [engine.submit(r) for r in requests]
            engine.continue_generation()
            for f in futures:
                f.result(600)
            return time.perf_counter() - t, engine.stats["decode_forwards"] - before

        for row in rows:
            B = row["batch"]
            # Warm-up: the fast path captures its graphs for every length bucket the timed run meets.
            engine_run(B, new_tokens if engine_mode == "fast" else 4)
            s, steps = engine_run(B, new_tokens)
            kv_read = B * (P + new_tokens / 2) * per_token
            floor_s = (weight_bytes + kv_read) / bandwidth
            row.update(miles_tokens_per_s=round(B * new_tokens / s, 1), decode_steps=steps,
                       step_ms=round(1e3 * s / max(steps, 1), 3), floor_ms=round(1e3 * floor_s, 4))
            row["ratio"] = round(row["miles_tokens_per_s"] / row["hf_tokens_per_s"], 2)
            row["step_over_floor"] = round(row["step_ms"] / row["floor_ms"], 1)
            row["engine"] = engine_mode
    finally:
        engine.stop()
    if engine_mode == "fast":
        engine = None
        for row in rows:
            row["breakdown"] = breakdown(model_dir, device, dtype, row["batch"], P, new_tokens, bandwidth)
    return rows


def _engine_config(model_dir: str, device: str, dtype: str, batch: int, tokens: int, engine_mode: str):
    from miles.engine.config import EngineConfig

    # A context just long enough for the run, so the static KV cache gives every row all of it.
    return EngineConfig(model_path=model_dir, device=device, dtype=dtype, max_batch_size=batch, prefix_cache=False,
                        context_length=tokens + 16, fast_decode="on" if engine_mode == "fast" else "off")


def _timed_ms(fn, device: str, n: int) -> float:
    """Median milliseconds of `fn` over n calls, each waited for."""
    import statistics

    times = []
    for _ in range(n):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _kernel_ms(prof, device: str, calls: int) -> dict[str, float]:
    """Per call, the profiled ops' own device time (cpu: their own CPU time) by kind."""
    import torch

    kinds = {"attention_ms": 0.0, "matmul_ms": 0.0, "other_ms": 0.0}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue  # kernels appear again as their own events; their time is counted on the op that ran them
        us = (getattr(e, "self_device_time_total", None) if device == "cuda" else e.self_cpu_time_total) or 0.0
        op = e.key.split("::")[-1].lower()
        if "attention" in op or "flash" in op or "fmha" in op:
            kinds["attention_ms"] += us
        elif op in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm"):
            kinds["matmul_ms"] += us
        else:
            kinds["other_ms"] += us
    return {k: round(v / 1e3 / calls, 4) for k, v in kinds.items()}


def breakdown(model_dir: str, device: str, dtype: str, batch: int, prompt_len: int, new_tokens: int,
              bandwidth: float) -> dict:
    """One decode step of `batch` rows at half of `new_tokens`, taken apart (see the module docstring)."""
    from concurrent.futures import Future

    import torch
    from torch.profiler import ProfilerActivity, profile

    from miles.engine_api.sampling import SamplingParams
    from miles.engine_api.types import GenerateRequest
    from miles.engine.graphs import length_bucket
    from miles.engine.kv_cache import bytes_per_token
    from miles.engine.model_runner import ModelRunner
    from miles.engine.row import Row

    runner = ModelRunner(_engine_config(model_dir, device, dtype, batch, prompt_len + new_tokens, "fast"))
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(5, 300, (batch, prompt_len), generator=g).tolist()
    rows = [Row.of(GenerateRequest(rid=str(i), input_ids=tuple(p), params=SamplingParams(
        temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=i)), Future()) for i, p in enumerate(prompts)]
    runner.prefill(rows)
    for _ in range(max(new_tokens // 2 - 1, 1)):  # to the middle of the generation (graphs captured on the way)
        runner.decode()
    kv, fast = runner.kv, runner.fast
    n = 5 if device == "cpu" else 20
    with torch.inference_mode():
        step_ms = _timed_ms(runner.decode, device, n)
        forward_ms = _timed_ms(lambda: fast.run(batch), device, n)
        Lb = length_bucket(max(kv.lens) + 1, kv.cap)
        eager = lambda: fast.forward(kv, *kv.inputs(batch), Lb)  # noqa: E731
        eager_ms = _timed_ms(eager, device, n)
        logits = eager()
        sampling = runner.decoder.sampling[1]
        u = sampling.uniforms([r.draws for r in rows], torch.Generator())
        sampling_ms = _timed_ms(lambda: sampling.sample(logits, u), device, n)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                eager()
            _sync(device)
    kernels = _kernel_ms(prof, device, 3)
    kernel_ms = sum(kernels.values())
    unique = {t.data_ptr(): t for t in runner.model.state_dict().values()}  # a tied weight once
    weights = sum(t.numel() * t.element_size() for t in unique.values())
    per_token = bytes_per_token(runner.model)
    Bk, _ = fast.buckets(batch)
    return {"tokens_in_kv_mean": round(sum(kv.lens) / batch, 1), "graphs": fast.use_graphs,
            "step_ms": round(step_ms, 4), "forward_ms": round(forward_ms, 4), "forward_eager_ms": round(eager_ms, 4),
            "sampling_ms": round(sampling_ms, 4), "host_ms": round(max(step_ms - forward_ms - sampling_ms, 0.0), 4),
            "eager_kernels": kernels, "eager_kernel_ms": round(kernel_ms, 4),
            "launch_gap_ms": round(max(forward_ms - kernel_ms, 0.0), 4),
            "eager_launch_gap_ms": round(max(eager_ms - kernel_ms, 0.0), 4),
            "floor_ms": round(1e3 * (weights + batch * sum(kv.lens) / batch * per_token) / bandwidth, 4),
            "read_floor_ms": round(1e3 * (weights + Bk * Lb * per_token) / bandwidth, 4)}


def trainer(model_dir: str, device: str) -> dict:
    """Tokens/s of one optimizer step of miles' trainer against a plain bf16-autocast AdamW loop, on the
    same batch of sequences, micro-batches and policy-gradient loss, one after the other in one process."""
    import torch
    import torch.distributed as dist

    from miles.config.loader import build
    from miles.models.loading import load_model
    from miles.net import free_port
    from miles.trainer.config import TrainerConfig
    from miles.trainer.trainer import Trainer
    from miles.trainer.types import BatchTotals, TrainSequence

    small = device == "cpu"
    B, P, C, MB = (8, 8, 16, 4) if small else (128, 16, 128, 16)  # sequences, prompt, completion, micro-batch
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 300, (B, P + C), generator=g)
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(B)])

    def timed(step, n=2) -> float:
        step()  # warm-up: allocator, kernels, optimizer state
        _sync(device)
        t = time.perf_counter()
        for _ in range(n):
            step()
        _sync(device)
        return (time.perf_counter() - t) / n

    model = load_model(model_dir, device=device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")

    def plain_step():
        for i in range(0, B, MB):
            ids = tokens[i:i + MB].to(device)
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = model(ids).logits[:, P - 1:-1].float()  # (mb, C, V) predicting the completion
            lp = torch.log_softmax(logits, -1).gather(2, ids[:, P:, None])[..., 0]
            loss = -(adv[i:i + MB].to(device)[:, None] * lp).sum() / (B * C)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    plain_s = timed(plain_step)
    model = opt = None  # frees the plain loop before the trainer builds its own
    if device == "cuda":
        torch.cuda.empty_cache()
    seqs = [TrainSequence(tokens=tokens[i].tolist(), prompt_len=P, loss_mask=[1] * C, old_logprobs=[-5.0] * C,
                          advantage=float(adv[i])) for i in range(B)]
    cfg = build(TrainerConfig, {"device": device, "param_dtype": "bfloat16", "micro_batch_size": MB, "lr": 1e-6})
    t = Trainer(cfg, model_dir, 0, 1, "127.0.0.1", free_port())
    metrics: dict = {}
    try:
        miles_s = timed(lambda: metrics.update(t.train_step(seqs, BatchTotals.of(seqs))))
    finally:
        dist.destroy_process_group()
    n = B * (P + C)
    # Where miles' step goes (forward, backward, optimizer seconds of the last step), for the ratio's why.
    parts = {k.removeprefix("perf/"): round(v, 4) for k, v in metrics.items() if k.startswith("perf/train_")}
    return {"batch": [B, P + C], "micro_batch": MB, "plain_tokens_per_s": round(n / plain_s),
            "miles_tokens_per_s": round(n / miles_s), "ratio": round(plain_s / miles_s, 3), "miles_step_s": parts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="miles bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--only", default="decode,trainer", help="comma-separated parts: decode, trainer")
    ap.add_argument("--model", default="", help="a model directory (default: the preset, built on the device)")
    ap.add_argument("--preset", default="", help="default: qwen3-0.6b-shape on cuda, tiny-qwen3 on cpu")
    ap.add_argument("--batches", default="", help="decode batch sizes (default 64,256 on cuda, 4,8 on cpu)")
    ap.add_argument("--new-tokens", type=int, default=0, help="new tokens per sequence (default 256; 16 on cpu)")
    ap.add_argument("--engine", default="fast", choices=["fast", "eager"],
                    help="the engine's decode path: fast (static KV cache, CUDA graphs on cuda) or eager")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("miles bench gpu: torch sees no CUDA device; pass --device cpu for the small CPU run")
    cpu = args.device == "cpu"
    parts = [p for p in args.only.split(",") if p]
    bad = set(parts) - {"decode", "trainer"}
    if bad:
        raise SystemExit(f"miles bench gpu: unknown part(s) {sorted(bad)}; choose decode, trainer")
    model = args.model or build_model(args.preset or ("tiny-qwen3" if cpu else "qwen3-0.6b-shape"), args.device)
    out: dict = {"bench": "gpu", "device": torch.cuda.get_device_name(0) if not cpu else "cpu",
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if "decode" in parts:
        bw = copy_bandwidth(args.device)
        out["copy_gb_s"] = round(bw / 1e9, 1)
        batches = [int(b) for b in (args.batches or ("4,8" if cpu else "64,256")).split(",")]
        out["decode"] = decode(model, args.device, batches, args.new_tokens or (16 if cpu else 256), bw, args.engine)
    if "trainer" in parts:
        out["trainer"] = trainer(model, args.device)
    print(json.dumps(out))
    return 0
