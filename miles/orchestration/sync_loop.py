"""The synchronous schedule: generate → train → sync weights → evaluate → save, step after step.

Engines sit idle while the trainer works and vice versa; every sample of step k is generated
under weight version k, so training is exactly on-policy.
"""

from __future__ import annotations

import time


def groups_to_sequences(groups, algorithm):
    """Per-sample advantages within each group; drop groups with no signal (all rewards equal)."""
    from miles.trainer.types import TrainSequence

    seqs, dropped = [], 0
    for g in groups:
        if len(set(g.rewards)) == 1:
            dropped += 1
            continue
        for s, adv in zip(g.samples, algorithm.advantages(g.rewards)):
            seqs.append(TrainSequence(tokens=s.prompt_ids + s.response_ids, prompt_len=len(s.prompt_ids),
                                      loss_mask=s.loss_mask, old_logprobs=s.rollout_logprobs, advantage=adv))
    return seqs, dropped


def run_sync_loop(ctx) -> None:
    cfg, rollout, trainer, sink, progress = ctx.cfg, ctx.rollout, ctx.trainer, ctx.sink, ctx.progress
    from miles.trainer.algorithms import get_algorithm

    algorithm = get_algorithm(cfg.trainer.algorithm)
    for step in range(1, cfg.loop.num_steps + 1):
        t0 = time.perf_counter()
        groups, metrics = ctx.call(rollout.generate_groups)
        t1 = time.perf_counter()
        seqs, dropped = groups_to_sequences(groups, algorithm)
        metrics["buffer/groups_discarded_zero_std"] = dropped
        metrics["buffer/groups_trained"] = len(groups) - dropped
        if seqs:
            metrics.update(trainer.train_step(seqs))
        t2 = time.perf_counter()
        if step % cfg.loop.update_weights_interval == 0:
            metrics.update(trainer.sync_weights(step))
            ctx.policy_version = step
        t3 = time.perf_counter()
        if ctx.eval_due(step):
            metrics.update(ctx.call(rollout.evaluate))
        if cfg.loop.save_every and step % cfg.loop.save_every == 0:
            ctx.save(step)
        metrics.update({"perf/rollout_s": t1 - t0, "perf/train_s": t2 - t1, "perf/sync_s": t3 - t2,
                        "perf/step_s": time.perf_counter() - t0})
        sink.write(step, metrics)
        ctx.record(step, metrics)
        shown = {"reward": metrics["rollout/reward_mean"]}
        if "eval/accuracy" in metrics:
            shown["eval_acc"] = metrics["eval/accuracy"]
        progress.update(step, **shown, step_s=metrics["perf/step_s"])
