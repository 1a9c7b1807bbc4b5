"""The synchronous schedule: generate → train → sync weights → evaluate → save, step after step.

Engines sit idle while the trainer works and vice versa; every sample of step k is generated
under weight version k-1, the trainer's version when it trains them, so training is on-policy.
In the colocated placement the two sides also hand the shared cores to each other: engines release
their memory for the train step and take it back before the weights arrive.
The helpers below (train, push weights, end a step) are shared by the overlapped schedules.
"""

from __future__ import annotations


def run_sync_loop(ctx) -> None:
    cfg, rollout, trainer, progress = ctx.cfg, ctx.rollout, ctx.trainer, ctx.progress
    from miles.metrics.timers import StepTimer

    colocated = cfg.placement.mode == "colocated"
    for step in range(ctx.start_step + 1, cfg.loop.num_steps + 1):
        timer = StepTimer()
        # On a terminal the progress line polls the manager for samples done so far (samples/s live).
        progress.phase("rollout", poll=lambda: ctx.call(rollout.live_stats))
        with timer.span("rollout"):
            metrics = ctx.call(rollout.generate_batch)
            groups, buffer_metrics = ctx.call(rollout.collect)
        metrics.update(buffer_metrics)
        if colocated:
            ctx.engine_memory("release")  # the trainer's turn on the shared cores
        train_on(ctx, step, groups, metrics, timer)
        if colocated:
            ctx.engine_memory("resume")
        push_weights(ctx, step, metrics, timer)
        # Sync schedule: the trainer waits for the whole collection before it can start.
        timer.add("perf/wait_data_s", timer.spans["perf/rollout_s"])
        end_step(ctx, step, metrics, timer)


# -- the parts every schedule shares ----------------------------------------------------------------
def train_on(ctx, step: int, groups, metrics: dict, timer) -> None:
    """One optimizer step on these groups; the trainer's policy version becomes `step`."""
    from miles.metrics.timers import staleness_counts

    metrics.update(staleness_counts(groups, ctx.policy_version))
    # The buffer's filter already dropped what should not train: every group here is trained.
    metrics["buffer/groups_trained"] = len(groups)
    metrics["buffer/samples_trained"] = sum(len(g.samples) for g in groups)
    ctx.progress.phase("train")
    if ctx.faults is not None:
        ctx.faults.before_train(step, ctx.trainer)
    with timer.span("train"), ctx.weights_lock():
        if groups:
            metrics.update(ctx.trainer.train_groups(groups))
        ctx.policy_version = step


def push_weights(ctx, step: int, metrics: dict, timer) -> None:
    """Push weights on the configured cadence and tell the rollout side the new versions."""
    ctx.progress.phase("sync")
    loop = ctx.cfg.loop
    # In the sync schedule the engines are idle during a push, so there is nothing to pause.
    pause = loop.pause_mode if loop.schedule != "sync" and loop.pause_mode != "none" else None
    with timer.span("sync"):
        if step % loop.update_weights_interval == 0:
            if pause:
                ctx.call(ctx.rollout.pause_engines, pause)
            try:
                metrics.update(ctx.sync_weights(step))
            finally:
                if pause:
                    ctx.call(ctx.rollout.continue_engines)
            ctx.weight_version = step
            ctx.call(ctx.rollout.set_versions, step, step)
        else:
            ctx.call(ctx.rollout.set_versions, step)


def end_step(ctx, step: int, metrics: dict, timer) -> None:
    """Evaluate and save when due, then write the step's record and show progress."""
    cfg, progress = ctx.cfg, ctx.progress
    if ctx.fleet is not None:
        ctx.fleet.raise_if_failed()  # an engine that could not be replaced ends the run here, named
    if ctx.eval_due(step):
        progress.phase("eval")
        with timer.span("eval"):
            metrics.update(ctx.call(ctx.rollout.evaluate))
    if cfg.loop.save_every and step % cfg.loop.save_every == 0:
        progress.phase("save")
        ctx.save(step)
    metrics = timer.finish(metrics)
    ctx.sink.write(step, metrics)
    ctx.record(step, metrics)
    shown = {"reward": metrics.get("rollout/reward_mean", float("nan"))}
    if "eval/accuracy" in metrics:
        shown["eval_acc"] = metrics["eval/accuracy"]
    if "rollout/samples_per_s" in metrics:
        shown["samples/s"] = metrics["rollout/samples_per_s"]
    progress.update(step, **shown, step_s=metrics["perf/step_s"])
