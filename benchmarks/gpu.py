"""`miles bench gpu`: the built-in engine's decode and the trainer's step against their baselines and
the memory floor, on one device (cuda by default; `--device cpu` runs small sizes, CI's smoke).

  * decode: B sequences of a 16-token prompt, each sampled to exactly N new tokens (EOS ignored), by
    transformers' generate() and by the built-in engine (in this process, no HTTP), same model and
    dtype (bf16 on cuda). Per batch: tokens/s of each and their ratio, the engine's time per decode
    step, and the floor: the bytes one decode step must read (every weight once, plus the batch's KV
    at its mean length) over the device-copy bandwidth measured in the same run.
  * trainer: one optimizer step of miles' trainer (FSDP2, bf16 compute over fp32 master weights)
    against a plain bf16-autocast AdamW loop on the same batch, micro-batches and policy-gradient loss.
The model is Qwen3-0.6B-shaped (random weights, built on the device) unless --model names a directory.

    miles bench gpu [--device cuda] [--only decode,trainer] [--batches 64,256] [--new-tokens 256]
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


def decode(model_dir: str, device: str, batches: list[int], new_tokens: int, bandwidth: float) -> list[dict]:
    import torch

    from miles.models.loading import load_model
    from miles.rollout.engine.config import EngineConfig
    from miles.rollout.engine.engine import Engine
    from miles.rollout.engine.kv_cache import bytes_per_token
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
    engine = Engine(EngineConfig(model_path=model_dir, device=device, dtype=dtype, max_batch_size=max(batches),
                                 prefix_cache=False))
    try:
        def engine_run(B: int, n: int) -> tuple[float, int]:
            prompts = torch.randint(5, 300, (B, P), generator=g).tolist()
            before = engine.stats["decode_forwards"]
            t = time.perf_counter()
            futures = [engine.submit(engine.make_request(p, SamplingParams(temperature=1.0, max_new_tokens=n,
                                                                           ignore_eos=True, seed=i)))
                       for i, p in enumerate(prompts)]
            for f in futures:
                f.result(600)
            return time.perf_counter() - t, engine.stats["decode_forwards"] - before

        for row in rows:
            B = row["batch"]
            engine_run(B, 4)
            s, steps = engine_run(B, new_tokens)
            kv_read = B * (P + new_tokens / 2) * per_token
            floor_s = (weight_bytes + kv_read) / bandwidth
            row.update(miles_tokens_per_s=round(B * new_tokens / s, 1), decode_steps=steps,
                       step_ms=round(1e3 * s / max(steps, 1), 3), floor_ms=round(1e3 * floor_s, 4))
            row["ratio"] = round(row["miles_tokens_per_s"] / row["hf_tokens_per_s"], 2)
            row["step_over_floor"] = round(row["step_ms"] / row["floor_ms"], 1)
    finally:
        engine.stop()
    return rows


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
    try:
        miles_s = timed(lambda: t.train_step(seqs, BatchTotals.of(seqs)))
    finally:
        dist.destroy_process_group()
    n = B * (P + C)
    return {"batch": [B, P + C], "micro_batch": MB, "plain_tokens_per_s": round(n / plain_s),
            "miles_tokens_per_s": round(n / miles_s), "ratio": round(plain_s / miles_s, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="miles bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--only", default="decode,trainer", help="comma-separated parts: decode, trainer")
    ap.add_argument("--model", default="", help="a model directory (default: the preset, built on the device)")
    ap.add_argument("--preset", default="", help="default: qwen3-0.6b-shape on cuda, tiny-qwen3 on cpu")
    ap.add_argument("--batches", default="", help="decode batch sizes (default 64,256 on cuda, 4,8 on cpu)")
    ap.add_argument("--new-tokens", type=int, default=0, help="new tokens per sequence (default 256; 16 on cpu)")
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
        out["decode"] = decode(model, args.device, batches, args.new_tokens or (16 if cpu else 256), bw)
    if "trainer" in parts:
        out["trainer"] = trainer(model, args.device)
    print(json.dumps(out))
    return 0
