"""The synchronous schedule: generate → train → sync weights → evaluate → save, step after step.

    engines: [gen 1]               [gen 2]               [gen 3]
    trainer:        [train 1][sync 1]     [train 2][sync 2]     ...

Who waits: the trainer waits for the whole batch; the engines wait for the push. Every sample of
step k is generated under weight version k-1, the trainer's version when it trains on it, so
training is on-policy. In the colocated placement the two sides also hand the shared cores to each
other: engines release their memory for the train step and take it back before the weights arrive.
"""

from __future__ import annotations

from miles.metrics.timers import StepTimer
from miles.orchestration.context import TrainContext
from miles.orchestration.steps import end_step, push_weights, train_on


def run_sync_loop(ctx: TrainContext) -> None:
    rollout, progress = ctx.rollout, ctx.progress
    colocated = ctx.cfg.placement.mode == "colocated"
    for step in range(ctx.start_step + 1, ctx.cfg.loop.num_steps + 1):
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
