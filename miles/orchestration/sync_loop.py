"""The synchronous schedule: generate → train → sync weights → evaluate → save, step after step.

Engines sit idle while the trainer works and vice versa; every sample of step k is generated
under weight version k, so training is exactly on-policy.
"""

from __future__ import annotations


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
    from miles.metrics.timers import StepTimer, staleness_counts
    from miles.trainer.algorithms import get_algorithm

    algorithm = get_algorithm(cfg.trainer.algorithm)
    for step in range(1, cfg.loop.num_steps + 1):
        timer = StepTimer()
        progress.phase("rollout")
        with timer.span("rollout"):
            groups, metrics = ctx.call(rollout.generate_groups)
        metrics.update(staleness_counts(groups, ctx.policy_version))
        seqs, dropped = groups_to_sequences(groups, algorithm)
        metrics["buffer/groups_discarded_zero_std"] = dropped
        metrics["buffer/groups_trained"] = len(groups) - dropped
        progress.phase("train")
        with timer.span("train"):
            if seqs:
                metrics.update(trainer.train_step(seqs))
        progress.phase("sync")
        with timer.span("sync"):
            if step % cfg.loop.update_weights_interval == 0:
                metrics.update(trainer.sync_weights(step))
                ctx.policy_version = step
        if ctx.eval_due(step):
            progress.phase("eval")
            with timer.span("eval"):
                metrics.update(ctx.call(rollout.evaluate))
        if cfg.loop.save_every and step % cfg.loop.save_every == 0:
            progress.phase("save")
            ctx.save(step)
        timer.add("perf/wait_data_s", timer.spans["perf/rollout_s"])
        metrics = timer.finish(metrics)
        sink.write(step, metrics)
        ctx.record(step, metrics)
        shown = {"reward": metrics["rollout/reward_mean"]}
        if "eval/accuracy" in metrics:
            shown["eval_acc"] = metrics["eval/accuracy"]
        if "rollout/samples_per_s" in metrics:
            shown["samples/s"] = metrics["rollout/samples_per_s"]
        progress.update(step, **shown, step_s=metrics["perf/step_s"])
