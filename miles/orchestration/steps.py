"""The steps every schedule shares: train on groups, push weights on the cadence, end the step.

A schedule decides only *when* these run and what overlaps them (see sync_loop, one_step_off,
async_loop). Each step records its time in the step's `StepTimer` and its figures in `metrics`.
"""

from __future__ import annotations

from miles.buffer.types import Group
from miles.metrics.timers import StepTimer, staleness_counts
from miles.orchestration.context import TrainContext


def train_on(ctx: TrainContext, step: int, groups: list[Group], metrics: dict, timer: StepTimer) -> None:
    """One optimizer step on these groups; the trainer's policy version becomes `step`."""
    metrics.update(staleness_counts(groups, ctx.policy_version))
    # The buffer's filter already dropped what should not train: every group here is trained.
    metrics["buffer/groups_trained"] = len(groups)
    metrics["buffer/samples_trained"] = sum(len(g.samples) for g in groups)
    ctx.progress.phase("train")
    if ctx.faults is not None:
        if step in ctx.cfg.fault.steps_of("kill_trainer"):
            # A scheduled trainer kill stands for a rank dying once the last save is on disk, so the
            # point the run goes back to is the same on a fast machine and a slow one (a kill in the
            # middle of a background write: tests/unit/trainer/test_checkpoint_writes.py).
            ctx.checkpoints.wait()
        ctx.faults.before_train(step, ctx.trainer, lambda: ctx.call(ctx.rollout.reward_worker_pids))
    with timer.span("train"), ctx.weights_lock():
        if groups:
            metrics.update(ctx.trainer.train_groups(groups))
        ctx.policy_version = step


def push_weights(ctx: TrainContext, step: int, metrics: dict, timer: StepTimer) -> None:
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


def end_step(ctx: TrainContext, step: int, metrics: dict, timer: StepTimer) -> None:
    """Evaluate when due, write the step's record, then save when due and show progress.

    The record goes first: a checkpoint of step k then implies that step k's record exists, so a run
    resumed from it (metrics.jsonl cut back to step k) has no hole. The save is thus not in perf/step_s.
    """
    cfg, progress = ctx.cfg, ctx.progress
    if ctx.fleet is not None:
        ctx.fleet.raise_if_failed()  # an engine that could not be replaced ends the run here, named
        metrics.update(ctx.fleet.metrics())
    if ctx.eval_due(step):
        progress.phase("eval")
        with timer.span("eval"):
            metrics.update(ctx.call(ctx.rollout.evaluate))
    metrics = timer.finish(metrics)
    ctx.sink.write(step, metrics)
    ctx.record(step, metrics)
    if cfg.loop.save_every and step % cfg.loop.save_every == 0:
        progress.phase("save")
        ctx.save(step)
        if ctx.faults is not None:
            ctx.faults.after_save(step, ctx.wait_for_saves)
    shown = {"reward": metrics.get("rollout/reward_mean", float("nan"))}
    if "eval/accuracy" in metrics:
        shown["eval_acc"] = metrics["eval/accuracy"]
    if "rollout/samples_per_s" in metrics:
        shown["samples/s"] = metrics["rollout/samples_per_s"]
    progress.update(step, **shown, step_s=metrics["perf/step_s"])
