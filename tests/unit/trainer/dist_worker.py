"""Runs trainer cases on N real gloo ranks (torch.multiprocessing) and saves each case's full
gradients and metrics from rank 0. Driven by test_parallel.py: python dist_worker.py SPEC.json"""

from __future__ import annotations

import json
import os
import random
import sys


def make_batch(seed: int, n: int, group: int = 1):
    """n sequences; with `group` > 1, runs of `group` consecutive ones continue the same prompt."""
    from miles.trainer.types import TrainSequence

    rng = random.Random(seed)
    seqs = []
    for i in range(n):
        if i % group == 0:
            prompt = [rng.randint(5, 300) for _ in range(rng.randint(2, 9))]
        P, R = len(prompt), rng.randint(1, 7)
        mask = [1] * R
        if R > 2:
            mask[1] = 0  # an environment token inside the response
        seqs.append(TrainSequence(tokens=prompt + [rng.randint(5, 300) for _ in range(R)], prompt_len=P,
                                  loss_mask=mask, old_logprobs=[-rng.uniform(4.0, 7.0) for _ in range(R)],
                                  advantage=rng.choice([-1.0, -0.5, 0.5, 1.0])))
    return seqs


def with_routed_experts(seqs, seed: int, layers: int, experts: int, top_k: int):
    """Attach made-up engine routing (distinct experts per token and layer) for replay cases."""
    import dataclasses

    import torch

    from miles.models.moe import encode_routed_experts

    g = torch.Generator().manual_seed(seed)
    return [dataclasses.replace(s, routed_experts=encode_routed_experts(torch.stack([
        torch.randperm(experts, generator=g)[:top_k] for _ in range((len(s.tokens) - 1) * layers)
    ]).view(len(s.tokens) - 1, layers, top_k))) for s in seqs]


def run_rank(rank: int, world: int, spec: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from miles.config.loader import build
    from miles.orchestration.trainer_group import split_for_ranks
    from miles.trainer.batching import prepare_global_batch
    from miles.trainer.trainer import Trainer
    from miles.trainer.config import TrainerConfig

    results = {}
    for case in spec["cases"]:
        cfg = build(TrainerConfig, {"num_ranks": world, **case["trainer"]})
        trainer = Trainer(cfg, case["model"], rank, world, "127.0.0.1", spec["port"])
        seqs = make_batch(spec["seed"], spec["n"], case.get("group", 1))
        if case.get("routed"):
            seqs = with_routed_experts(seqs, spec["seed"], *case["routed"])
        seqs, totals = prepare_global_batch(seqs, trainer.algorithm)
        width = max(cfg.tensor_parallel_size, cfg.expert_parallel_size)
        mine = split_for_ranks(seqs, world, width)[rank]
        shared = trainer._shares_prompts(mine, trainer.algorithm)
        metrics = trainer.compute_gradients(mine, totals)
        grads = {}
        for name, p in trainer.backend.model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("_orig_mod.")] = g.detach().clone()
        local_rows = {n: (p.to_local() if hasattr(p, "to_local") else p).shape[0]
                      for n, p in trainer.backend.model.named_parameters() if "experts" in n}
        results[case["name"]] = {"grads": grads, "metrics": metrics, "local_expert_rows": local_rows,
                                 "shared_prompts": shared}
        del trainer
    if rank == 0:
        torch.save(results, spec["out"])


def main() -> None:
    import torch.multiprocessing as mp

    spec = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(run_rank, args=(spec["world"], spec), nprocs=spec["world"])


if __name__ == "__main__":
    main()
