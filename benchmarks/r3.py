"""`miles bench r3`: train–inference routing mismatch of an MoE model, without and with Rollout
Routing Replay.

The tiny Qwen3-MoE preset (8 experts, top-2, weights redrawn at std 0.1 so routing matters) is
served by a bfloat16 built-in engine and trained by the float32 FSDP trainer: a short GRPO run
(generate over HTTP with routed experts → reward → one optimizer step → weights into the engine),
once with replay off and once with it on, from the same checkpoint and seeds. Reported per arm,
averaged over the steps:
  mismatch_rate        token × MoE-layer pairs whose experts in the trainer's forward differ from
                       the engine's: the experts the trainer's MoE blocks actually received
                       (after replay, when on), read at the experts' input
  router_mismatch_rate the trainer router's own top-k against the engine's, before replay
                       (train/r3_mismatch_rate)
  logprob_diff         mean |trainer − engine| logprob of the sampled tokens (train/rollout_logprob_abs_diff)
The reward (share of digit characters in the response) only gives GRPO a signal to follow; the
run is about consistency, not learning. Weights go into the engine in-process (the transports are
measured by `miles bench sync`). Last line: one JSON object.

    miles bench r3 [--steps 10] [--prompts 8] [--samples 4] [--max-new-tokens 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time


def digit_share(text: str, _label=None) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def experts_input_mismatch(trainer, counts: dict):
    """Forward pre-hooks on every MoE block's experts: compare the ids they receive with the
    engine's ids of the micro-batch being run (set in `counts["routed"]` before each forward)."""
    from miles.models.moe import routers

    names = {id(m): n for n, m in trainer.backend.model.named_modules()}
    modules = dict(trainer.backend.model.named_modules())
    handles = []
    for layer, router in enumerate(routers(trainer.backend.model)):
        experts = modules[names[id(router)].removesuffix("gate") + "experts"]

        def hook(_m, args, layer=layer):
            routed = counts.get("routed")
            if routed is None:
                return
            engine = routed[:, :, layer].reshape(-1, routed.shape[-1])
            known = engine[:, 0] >= 0
            differs = (args[1].sort(-1).values != engine.sort(-1).values).any(-1) & known
            counts["pairs"] += int(known.sum())
            counts["differ"] += int(differs.sum())
        handles.append(experts.register_forward_pre_hook(hook))
    return handles


def run_arm(model_dir: str, replay: bool, args) -> dict:
    import httpx
    import torch

    from miles.buffer.types import Group
    from miles.config.loader import build
    from miles.net import free_port
    from miles.buffer.filters import nonzero_std
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread
    from miles.rollout.generate import SamplingParams, generate
    from miles.trainer.backends import fsdp
    from miles.trainer.trainer import Trainer
    from miles.trainer.batching import prepare_global_batch, sequences_from_groups
    from miles.trainer.config import TrainerConfig

    cfg = build(TrainerConfig, {"lr": args.lr, "routing_replay": replay, "algorithm": {"name": "grpo"}})
    trainer = Trainer(cfg, model_dir, 0, 1, "127.0.0.1", free_port(), seed=0)
    server = start_server_thread(EngineConfig(model_path=model_dir, dtype="bfloat16", seed=0))
    counts = {"pairs": 0, "differ": 0}
    handles = experts_input_mismatch(trainer, counts)
    # The trainer builds each micro-batch right before its forward; note its engine routing there.
    build_mb = fsdp.build_micro_batch

    def noting(*a, **kw):
        mb = build_mb(*a, **kw)
        counts["routed"] = mb.routed
        return mb
    fsdp.build_micro_batch = noting
    prompts = [[3 + p, 17 + 5 * p, 9, 40 + p] for p in range(args.prompts)]
    steps = []
    try:
        for step in range(args.steps):
            async def rollout():
                async with httpx.AsyncClient(timeout=300) as c:
                    return await asyncio.gather(*(
                        generate(c, server.url, ids, SamplingParams(max_new_tokens=args.max_new_tokens,
                                                                    seed=1000 * step + 10 * p + k),
                                 return_routed_experts=True, prompt_index=p)
                        for p, ids in enumerate(prompts) for k in range(args.samples)))
            samples = asyncio.run(rollout())
            for s in samples:
                s.reward = digit_share(s.response_text)
            groups = [Group(samples[i:i + args.samples]) for i in range(0, len(samples), args.samples)]
            # As the run's default buffer filter does: groups with equal rewards carry no signal.
            seqs = sequences_from_groups([g for g in groups if nonzero_std(g)], trainer.algorithm)
            if not seqs:
                continue
            counts.update(pairs=0, differ=0)
            seqs, totals = prepare_global_batch(seqs, trainer.algorithm)
            m = trainer.train_step(seqs, totals)
            steps.append({"mismatch_rate": counts["differ"] / max(counts["pairs"], 1),
                          "router_mismatch_rate": m["train/r3_mismatch_rate"],
                          "logprob_diff": m["train/rollout_logprob_abs_diff"],
                          "reward": sum(s.reward for s in samples) / len(samples)})
            with torch.no_grad():
                server.engine.apply_weights(dict(trainer.full_named_tensors()), step + 1)
    finally:
        fsdp.build_micro_batch = build_mb
        for h in handles:
            h.remove()
        server.stop()
    mean = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
    return {**mean, "steps_trained": len(steps), "per_step": steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="miles bench r3", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-4)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from miles.models.presets import build_tiny_model
    from miles.net import free_port

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="miles-bench-r3-") as tmp:
        model_dir = str(build_tiny_model("tiny-qwen3-moe", tmp, init_std=0.1))
        off = run_arm(model_dir, False, args)
        print(f"R3 off: mismatch {off['mismatch_rate']:.4f}, |Δlogprob| {off['logprob_diff']:.4f}", file=sys.stderr)
        on = run_arm(model_dir, True, args)
        print(f"R3 on:  mismatch {on['mismatch_rate']:.4f}, |Δlogprob| {on['logprob_diff']:.4f}", file=sys.stderr)
    dist.destroy_process_group()
    out = {
        "model": "tiny-qwen3-moe (8 experts, top-2, init std 0.1)", "engine_dtype": "bfloat16",
        "trainer_dtype": "float32", "steps": args.steps, "samples_per_step": args.prompts * args.samples,
        "mismatch_rate_without_r3": off["mismatch_rate"], "mismatch_rate_with_r3": on["mismatch_rate"],
        "router_mismatch_rate_without_r3": off["router_mismatch_rate"],
        "router_mismatch_rate_with_r3": on["router_mismatch_rate"],
        "logprob_diff_without_r3": off["logprob_diff"], "logprob_diff_with_r3": on["logprob_diff"],
        "logprob_diff_ratio": on["logprob_diff"] / off["logprob_diff"],
        "reward_without_r3": off["reward"], "reward_with_r3": on["reward"],
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
