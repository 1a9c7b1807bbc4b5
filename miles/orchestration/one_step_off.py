"""The one-step-off schedule: generation of step k+1 overlaps training of step k.

    engines: [gen 1][gen 2      ][gen 3      ] ...
    trainer:        [train 1][sync 1][train 2][sync 2] ...

The rollout manager generates the next batch in the background while the trainer trains on the
batch before it, so each batch is at most one policy version old when it is trained (checked by
the buffer on the way out). Weights are pushed right after each train step, while the engines are
still generating: they apply a version atomically between decode steps and each sample records
the versions it ran under. Who waits: the trainer waits for the next batch when generation is the
slower side; generation waits for nothing. Needs the disaggregated placement.

A checkpoint taken at the end of step k holds step k+1's batch as it stood: groups that had arrived
(in the buffer) and prompts still being generated. A run resumed from it regenerates only those
prompts, so step k+1 trains the same prompts it would have without the interruption.
"""

from __future__ import annotations

import contextlib

from miles.metrics.timers import StepTimer
from miles.orchestration.context import TrainContext
from miles.orchestration.steps import end_step, push_weights, train_on


def run_one_step_off_loop(ctx: TrainContext) -> None:
    rollout, num_steps = ctx.rollout, ctx.cfg.loop.num_steps
    first = rollout.regenerate_in_flight if ctx.batch_in_flight else rollout.generate_batch
    pending = ctx.submit(first)
    try:
        for step in range(ctx.start_step + 1, num_steps + 1):
            timer = StepTimer()
            ctx.progress.phase("wait for data")
            with timer.span("wait_data"):
                metrics, pending = pending(), None
                groups, buffer_metrics = ctx.call(rollout.collect)
            metrics.update(buffer_metrics)
            t_gen = metrics.get("rollout/time_s", 0.0)
            ctx.batch_in_flight = step < num_steps
            if ctx.batch_in_flight:
                pending = ctx.submit(rollout.generate_batch)  # step k+1's batch, overlapping this train step
            train_on(ctx, step, groups, metrics, timer)
            push_weights(ctx, step, metrics, timer)
            timer.add("perf/rollout_s", t_gen)
            end_step(ctx, step, metrics, timer)
    except Exception:
        # A failed step leaves no batch generating behind it: a restart from a checkpoint restores
        # the buffer, and a batch still putting groups into it would land on the restored state.
        if pending is not None:
            with contextlib.suppress(Exception):
                pending()
        raise
