"""A user's schedule given as `module:function` in a run config: train on one batch per step, push
every step, never evaluate in between (the extension point under test)."""

from __future__ import annotations

from miles.metrics.timers import StepTimer
from miles.orchestration.steps import push_weights, train_on


def generate_train_push(ctx) -> None:
    for step in range(ctx.start_step + 1, ctx.cfg.loop.num_steps + 1):
        timer = StepTimer()
        metrics = ctx.call(ctx.rollout.generate_batch)
        groups, _ = ctx.call(ctx.rollout.collect)
        train_on(ctx, step, groups, metrics, timer)
        push_weights(ctx, step, metrics, timer)
        ctx.record(step, timer.finish(metrics))
