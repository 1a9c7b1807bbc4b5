"""`miles bench train`: training tokens/s of the miles trainer against a plain loop.

Contenders, on the same fixed batches of the tiny Qwen3 preset, in one run:
  miles      the FSDP2 trainer on 1 rank (GRPO loss, global-token normalisation, grad clip)
  plain      a single-process transformers model + torch AdamW with the same loss, no FSDP
  offload    the miles trainer with optimizer state offloaded to disk (step-time cost, peak
             resident optimizer-state bytes against the in-memory trainer)
  two ranks  the miles trainer on 2 gloo ranks over the same global batch (2 processes)
The 1-rank contenders share one process and take turns step by step, so load from neighbours hits
them alike. Last line: one JSON object with the raw figures and ratio = miles / plain.

With `--backend megatron` the contenders are the Megatron backend at tensor parallel 2 and the FSDP
backend on the same 2 gloo ranks (one spawned world, each trainer timed in turn over the same global
batch), and the plain loop in one process; ratios megatron / fsdp and megatron / plain.

    miles bench train [--steps 20] [--batch 32] [--warmup 3] [--backend megatron]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time


def make_batch(tokenizer_vocab: int, n: int, seed: int = 0):
    from miles.trainer.types import TrainSequence

    rng = random.Random(seed)
    seqs = []
    for _ in range(n):
        P, R = rng.randint(8, 16), rng.randint(8, 24)
        seqs.append(TrainSequence(tokens=[rng.randrange(5, tokenizer_vocab) for _ in range(P + R)], prompt_len=P,
                                  loss_mask=[1] * R, old_logprobs=[-rng.uniform(4.0, 6.0) for _ in range(R)],
                                  advantage=rng.choice([-1.0, 1.0])))
    return seqs


class PlainLoop:
    """What a user would write by hand: one model, AdamW, the clipped surrogate over a padded batch."""

    def __init__(self, model_path: str, lr: float):
        import torch

        from miles.models.loading import load_model

        self.model = load_model(model_path, "float32").train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, seqs) -> None:
        import torch

        B, T = len(seqs), max(len(s.tokens) for s in seqs)
        ids = torch.zeros(B, T, dtype=torch.long)
        attn = torch.zeros(B, T, dtype=torch.long)
        mask, old, adv = torch.zeros(B, T - 1), torch.zeros(B, T - 1), torch.zeros(B, T - 1)
        for i, s in enumerate(seqs):
            ids[i, :len(s.tokens)] = torch.tensor(s.tokens)
            attn[i, :len(s.tokens)] = 1
            lo, n = s.prompt_len - 1, len(s.loss_mask)
            mask[i, lo:lo + n] = 1
            old[i, lo:lo + n] = torch.tensor(s.old_logprobs)
            adv[i, lo:lo + n] = s.advantage
        logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        ((loss * mask).sum() / mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _two_rank_worker(rank: int, model_path: str, port: int, args, out_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    from miles.orchestration.trainer_group import split_for_ranks
    from miles.trainer.trainer import Trainer
    from miles.trainer.config import TrainerConfig
    from miles.trainer.types import BatchTotals

    trainer = Trainer(TrainerConfig(num_ranks=2, lr=1e-5), model_path, rank, 2, "127.0.0.1", port)
    batch = make_batch(300, args.batch)
    totals = BatchTotals.of(batch)
    mine = split_for_ranks(batch, 2, 1)[rank]
    elapsed = 0.0
    for i in range(args.warmup + args.steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        trainer.train_step(mine, totals)
        if i >= args.warmup:
            elapsed += time.perf_counter() - t0
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"elapsed": elapsed}, f)


def _megatron_worker(rank: int, model_path: str, port: int, args, out_path: str) -> None:
    """FSDP on 2 ranks, then Megatron at TP 2 on the same ranks: seconds for the timed steps of each."""
    import torch

    torch.set_num_threads(1)
    from miles.config.loader import build
    from miles.orchestration.trainer_group import split_for_ranks
    from miles.trainer.config import TrainerConfig
    from miles.trainer.trainer import Trainer
    from miles.trainer.types import BatchTotals

    batch = make_batch(300, args.batch)
    totals = BatchTotals.of(batch)
    elapsed = {}
    for name, keys in (("fsdp", {}), ("megatron", {"backend": "megatron", "tensor_parallel_size": 2})):
        cfg = build(TrainerConfig, {"num_ranks": 2, "lr": 1e-5, **keys})
        trainer = Trainer(cfg, model_path, rank, 2, "127.0.0.1", port)
        mine = split_for_ranks(batch, 2, cfg.replica_ranks)[rank]
        elapsed[name] = 0.0
        for i in range(args.warmup + args.steps):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            trainer.train_step(mine, totals)
            if i >= args.warmup:
                elapsed[name] += time.perf_counter() - t0
        del trainer
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(elapsed, f)


def megatron_main(args) -> int:
    import subprocess

    import torch

    torch.set_num_threads(1)
    from miles.models.presets import build_tiny_model

    tmp = tempfile.mkdtemp(prefix="miles-bench-train-megatron-")
    model_path = str(build_tiny_model("tiny-qwen3", os.path.join(tmp, "model")))
    batch = make_batch(300, args.batch)
    n_tok = sum(len(s.tokens) for s in batch) * args.steps
    plain = PlainLoop(model_path, 1e-5)
    plain_s = 0.0
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        plain.step(batch)
        if i >= args.warmup:
            plain_s += time.perf_counter() - t0
    del plain
    out = os.path.join(tmp, "megatron.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--warmup",
                    str(args.warmup), "--batch", str(args.batch), "--megatron-worker", model_path, out], check=True)
    two = json.load(open(out))
    result = {"megatron_tp2_tokens_per_s": n_tok / two["megatron"], "fsdp_two_rank_tokens_per_s": n_tok / two["fsdp"],
              "plain_tokens_per_s": n_tok / plain_s, "megatron_vs_fsdp": two["fsdp"] / two["megatron"],
              "megatron_vs_plain": plain_s / two["megatron"], "steps": args.steps, "batch": args.batch,
              "tokens_per_step": n_tok // args.steps}
    print(json.dumps(result), flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=32, help="sequences per step (global batch)")
    p.add_argument("--skip-two-rank", action="store_true", help="only the single-process contenders")
    p.add_argument("--backend", choices=("fsdp", "megatron"), default="fsdp",
                   help="megatron: Megatron at TP 2 against FSDP on 2 ranks and the plain loop")
    p.add_argument("--two-rank-worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--megatron-worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.megatron_worker:
        import torch.multiprocessing as mp

        from miles.net import free_port

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_megatron_worker, args=(args.megatron_worker[0], free_port(), args, args.megatron_worker[1]),
                 nprocs=2)
        return 0
    if args.backend == "megatron":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        return megatron_main(args)
    if args.two_rank_worker:
        # Run as a script of its own so the spawned ranks can import this module by path.
        import torch.multiprocessing as mp

        from miles.net import free_port

        mp.spawn(_two_rank_worker, args=(args.two_rank_worker[0], free_port(), args, args.two_rank_worker[1]),
                 nprocs=2)
        return 0

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from miles.models.presets import build_tiny_model
    from miles.net import free_port
    from miles.trainer.trainer import Trainer
    from miles.trainer.config import TrainerConfig
    from miles.trainer.types import BatchTotals

    tmp = tempfile.mkdtemp(prefix="miles-bench-train-")
    model_path = str(build_tiny_model("tiny-qwen3", os.path.join(tmp, "model")))
    batch = make_batch(300, args.batch)
    tokens_per_step = sum(len(s.tokens) for s in batch)
    totals = BatchTotals.of(batch)

    port = free_port()
    miles = Trainer(TrainerConfig(lr=1e-5), model_path, 0, 1, "127.0.0.1", port)
    offload = Trainer(TrainerConfig(lr=1e-5, offload_optimizer="disk", offload_bucket_mb=1,
                                        offload_dir=os.path.join(tmp, "offload")), model_path, 0, 1, "127.0.0.1", port)
    plain = PlainLoop(model_path, 1e-5)
    contenders = {"miles": lambda: miles.train_step(batch, totals), "plain": lambda: plain.step(batch),
                  "offload": lambda: offload.train_step(batch, totals)}
    elapsed = dict.fromkeys(contenders, 0.0)
    for i in range(args.warmup + args.steps):
        order = list(contenders)
        random.Random(i).shuffle(order)  # no contender always runs right after another
        for name in order:
            t0 = time.perf_counter()
            contenders[name]()
            if i >= args.warmup:
                elapsed[name] += time.perf_counter() - t0
    n_tok = tokens_per_step * args.steps
    result = {
        "miles_tokens_per_s": n_tok / elapsed["miles"],
        "plain_tokens_per_s": n_tok / elapsed["plain"],
        "ratio": elapsed["plain"] / elapsed["miles"],
        "offload_disk_tokens_per_s": n_tok / elapsed["offload"],
        "offload_step_time_ratio": elapsed["offload"] / elapsed["miles"],
        "optimizer_state_bytes_resident_peak": miles.backend.optim.peak_resident_bytes,
        "offload_disk_state_bytes_resident_peak": offload.backend.optim.peak_resident_bytes,
        "offload_disk_buckets": len(offload.backend.optim.optimizers),
        "steps": args.steps, "batch": args.batch, "tokens_per_step": tokens_per_step,
    }
    result["offload_peak_saved_bytes"] = (result["optimizer_state_bytes_resident_peak"]
                                          - result["offload_disk_state_bytes_resident_peak"])
    del miles, offload, plain
    if not args.skip_two_rank:
        import subprocess

        out = os.path.join(tmp, "two_rank.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--warmup",
                        str(args.warmup), "--batch", str(args.batch), "--two-rank-worker", model_path, out], check=True)
        two = json.load(open(out))["elapsed"]
        result["two_rank_tokens_per_s"] = n_tok / two
        result["two_rank_vs_one_rank"] = result["two_rank_tokens_per_s"] / result["miles_tokens_per_s"]
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
