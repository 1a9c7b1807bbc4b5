"""`miles bench layouts`: one training step's forward and backward under each micro-batch layout.

The trainer lays a step's sequences out as padded rows (one sequence per row), padded rows on
shared prompts (`trainer.share_prompts`: each prompt once, each row from its prompt's last token on),
or packed rows (`trainer.pack_sequences`). Contenders, on the same sequences of one model, in turns:
  shared       padded rows on shared prompts (llama/mistral/qwen2/qwen3 on one rank)
  padded       padded rows
  packed       packed rows, attention a sequence at a time (trainer/packed_attention.py)
  packed_mask  packed rows through transformers' block-diagonal mask over the whole row (the baseline
               for `packed`: what a packed row cost before, and what a model packed_attention.py
               does not serve still pays)
Each builds its micro-batches as the trainer does (row lengths, longest-first bins within
`--max-tokens`, build_micro_batch) and runs the forwards the fsdp backend runs, the tokens'
logprobs and a token-mean loss, then the backward. Workloads (small-qwen3, random weights):
  long   16 prompts x 8 samples, 9-token prompts, responses of Pareto(1.2) lengths (scale 40, at most 256)
  short  32 prompts x 8 samples, 7-9-token prompts, 6-token responses (the arithmetic job's shape)
Last line: one JSON object, per workload and thread count the median seconds per contender, each
layout's computed tokens, and the ratios shared/packed and packed_mask/packed.

    miles bench layouts [--workloads long,short] [--threads 1,2] [--rounds 3] [--max-tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

CONTENDERS = ("shared", "padded", "packed", "packed_mask")


def sequences(workload: str, seed: int):
    from miles.trainer.types import TrainSequence

    rng = random.Random(seed)
    groups, samples = (16, 8) if workload == "long" else (32, 8)
    seqs = []
    for _ in range(groups):
        prompt = [rng.randint(5, 300) for _ in range(9 if workload == "long" else rng.randint(7, 9))]
        for _ in range(samples):
            n = min(256, int(40 * (1 / (1 - rng.random())) ** (1 / 1.2))) if workload == "long" else 6
            seqs.append(TrainSequence(tokens=prompt + [rng.randint(5, 300) for _ in range(n)], prompt_len=len(prompt),
                                      loss_mask=[1] * n, old_logprobs=[-1.0] * n, advantage=1.0))
    return seqs


def micro_batches(seqs, contender: str, max_tokens: int):
    from miles.trainer.batching import build_micro_batch, plan_micro_batches, row_length

    pack, share = contender.startswith("packed"), contender == "shared"
    bins = plan_micro_batches([row_length(s, share) for s in seqs], max_tokens, 10 ** 9, pack)
    mbs = [build_micro_batch([seqs[i] for i in b], [1.0] * len(b), pack, 0, share_prompts=share) for b in bins]
    cost = sum(mb.input_ids.numel() + (mb.shared.input_ids.numel() if mb.shared is not None else 0) for mb in mbs)
    return mbs, cost


def step(model, mbs, contender: str) -> float:
    from miles.trainer import packed_attention
    from miles.trainer.forward import logprobs_from_logits, shared_prompt_logits

    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    for mb in mbs:
        if contender == "packed":
            logits = packed_attention.logits(model, mb.input_ids, mb.position_ids, mb.packed)
        elif mb.shared is not None:
            logits = shared_prompt_logits(model, mb)
        else:  # padded rows, or a packed row under its N x N mask (position ids restart per sequence)
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                           use_cache=False).logits
        logp, _ = logprobs_from_logits(logits, mb.input_ids)
        (-(logp * mb.mask).sum() / mb.mask.sum()).backward()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench layouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="long,short", help="comma-separated: long, short")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, each timed in turn")
    p.add_argument("--rounds", type=int, default=3, help="timed steps per contender (after one untimed)")
    p.add_argument("--max-tokens", type=int, default=8192, help="trainer.max_tokens_per_micro_batch")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    if not names or set(names) - {"long", "short"}:
        p.error(f"--workloads: choose from long, short (got {args.workloads!r})")
    threads = [int(t) for t in args.threads.split(",") if t]
    if args.rounds < 1 or not threads or min(threads) < 1:
        p.error("--rounds and every --threads entry must be >= 1")

    import torch
    from transformers import AutoModelForCausalLM

    from miles.models.presets import build_tiny_model
    from miles.trainer import packed_attention

    path = build_tiny_model("small-qwen3", Path(tempfile.mkdtemp(prefix="miles-bench-layouts-")) / "model")
    masked = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").train()
    planned = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").train()
    if not packed_attention.enable(planned):
        sys.exit(f"miles bench layouts: {packed_attention.serves(planned)}")
    line = {"model": "small-qwen3", "max_tokens": args.max_tokens, "rounds": args.rounds, "workloads": {}}
    for name in names:
        seqs = sequences(name, args.seed)
        layouts = {c: micro_batches(seqs, c, args.max_tokens) for c in CONTENDERS}
        out = {"sequences": len(seqs), "tokens": sum(len(s.tokens) for s in seqs),
               "computed_tokens": {c: layouts[c][1] for c in ("shared", "padded", "packed")}}
        for t in threads:
            torch.set_num_threads(t)
            times = {c: [] for c in CONTENDERS}
            for r in range(args.rounds + 1):
                # Turns in a rotating order, so a machine that speeds up or slows down weighs on each alike.
                for c in CONTENDERS[r % 4:] + CONTENDERS[:r % 4]:
                    s = step(planned if c == "packed" else masked, layouts[c][0], c)
                    if r:
                        times[c].append(s)
            med = {c: statistics.median(v) for c, v in times.items()}
            out[f"threads_{t}"] = {"median_s": med, "runs_s": times,
                                   "shared_over_packed": med["shared"] / med["packed"],
                                   "padded_over_packed": med["padded"] / med["packed"],
                                   "mask_over_packed": med["packed_mask"] / med["packed"]}
            print(f"[bench layouts] {name}, {t} thread(s): " + ", ".join(f"{c} {med[c]:.3f} s" for c in CONTENDERS),
                  file=sys.stderr, flush=True)
        line["workloads"][name] = out
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
