"""Runs Megatron-backend cases on N real gloo ranks (torch.multiprocessing) and saves, from rank 0,
each case's per-token logprobs of a fixed batch, its step metrics and its exported weights after one
optimizer step. Driven by test_megatron.py: python megatron_worker.py SPEC.json"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))))

from tests.unit.trainer.dist_worker import make_batch  # noqa: E402


def run_rank(rank: int, world: int, spec: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from miles.config.loader import build
    from miles.orchestration.trainer_group import split_for_ranks
    from miles.trainer.batching import prepare_global_batch
    from miles.trainer.config import TrainerConfig
    from miles.trainer.trainer import Trainer

    results = {}
    for case in spec["cases"]:
        if "resume" in case:
            results[case["name"]] = resume_case(rank, world, spec, case)
            continue
        cfg = build(TrainerConfig, {"num_ranks": world, "lr": 1e-3, **case["trainer"]})
        cfg.validate()
        trainer = Trainer(cfg, case["model"], rank, world, "127.0.0.1", spec["port"])
        seqs = make_batch(spec["seed"], spec["n"])
        if case.get("routes"):
            seqs = with_routes(seqs, trainer.moe_shape, spec["seed"])
        seqs, totals = prepare_global_batch(seqs, trainer.algorithm)
        initial = {n: t.clone() for n, t in trainer.full_named_tensors() if t is not None}
        logprobs = trainer.proximal_logprobs(seqs)  # every rank scores the whole batch
        # Under pipeline parallelism the logprobs exist on the last stage only: take them from any rank.
        every: list = [None] * world
        torch.distributed.all_gather_object(every, logprobs)
        logprobs = [next(r[i] for r in every if r[i] is not None) for i in range(len(seqs))]
        metrics = trainer.train_step(split_for_ranks(seqs, world, cfg.replica_ranks)[rank], totals)
        weights = {n: t.clone() for n, t in trainer.full_named_tensors() if t is not None}
        results[case["name"]] = {"logprobs": logprobs, "metrics": metrics, "weights": weights, "initial": initial}
        del trainer
    if rank == 0:
        torch.save(results, spec["out"])


def resume_case(rank: int, world: int, spec: dict, case: dict) -> dict:
    """Two steps straight, with a checkpoint after the first; then a new trainer (at the case's `resume`
    layout) loads it and takes the second step again. Returns both second steps' weights and metrics."""
    import torch

    from miles.config.loader import build
    from miles.orchestration.trainer_group import split_for_ranks
    from miles.trainer.batching import prepare_global_batch
    from miles.trainer.config import TrainerConfig
    from miles.trainer.trainer import Trainer

    def step(trainer, cfg, seed):
        seqs, totals = prepare_global_batch(make_batch(seed, spec["n"]), trainer.algorithm)
        return trainer.train_step(split_for_ranks(seqs, world, cfg.replica_ranks)[rank], totals)

    def weights(trainer):
        return {n: t.clone() for n, t in trainer.full_named_tensors() if t is not None}

    out = {}
    ckpt = spec["out"] + f".{case['name']}.ckpt"
    cfg = build(TrainerConfig, {"num_ranks": world, "lr": 1e-3, **case["trainer"]})
    trainer = Trainer(cfg, case["model"], rank, world, "127.0.0.1", spec["port"])
    step(trainer, cfg, spec["seed"])
    trainer.step = 1
    trainer.save_checkpoint(ckpt)
    out["saved"] = weights(trainer)
    out["straight"] = {"metrics": step(trainer, cfg, spec["seed"] + 1), "weights": weights(trainer)}
    del trainer
    cfg = build(TrainerConfig, {"num_ranks": world, "lr": 1e-3, **case["trainer"], **case["resume"]})
    trainer = Trainer(cfg, case["model"], rank, world, "127.0.0.1", spec["port"])
    trainer.load_checkpoint(ckpt)
    out["loaded"] = weights(trainer)
    out["resumed"] = {"metrics": step(trainer, cfg, spec["seed"] + 1), "weights": weights(trainer),
                      "step": trainer.step}
    del trainer
    return out


def with_routes(seqs, shape, seed: int):
    """The sequences with recorded experts for every token: k distinct experts drawn at random, so
    replaying them changes the forward (an engine's own routes would mostly agree with the trainer's)."""
    import dataclasses

    import torch

    from miles.models.moe import encode_routed_experts

    layers, k = shape
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in seqs:
        ids = torch.rand(len(s.tokens), layers, 8, generator=g).argsort(-1)[..., :k]  # 8: tiny-qwen3-moe's experts
        out.append(dataclasses.replace(s, routed_experts=encode_routed_experts(ids)))
    return out


def main() -> None:
    import torch.multiprocessing as mp

    spec = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(run_rank, args=(spec["world"], spec), nprocs=spec["world"], join=True)


if __name__ == "__main__":
    main()
