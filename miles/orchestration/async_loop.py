"""The fully asynchronous schedule: engines never wait; the trainer collects groups from the buffer.

    prompt source ─► RolloutManager producer ─► engines (up to buffer.max_inflight_groups groups)
                                │ put (filters, failures)                 ▲
                                ▼                                         │ weights every
                          DataBuffer (capacity) ── get (staleness) ──► trainer ─┘ update_weights_interval

Who waits on whom (backpressure): the producer waits when `buffer.max_inflight_groups` groups are
in flight, when `buffer.capacity` finished groups are waiting for the trainer, and (with
`buffer.pacing`) while the oldest in-flight group is at the staleness limit. The trainer waits only
when fewer than one step's groups are ready. Engines keep decoding through weight pushes: a new
version is applied atomically between decode steps and every sample records the versions it ran
under, so staleness is exact (bounded by `buffer.max_staleness`, checked when the trainer collects).
Needs the disaggregated placement.
"""

from __future__ import annotations

import time

from miles.metrics.timers import StepTimer
from miles.orchestration.context import TrainContext
from miles.orchestration.steps import end_step, push_weights, train_on


def run_fully_async_loop(ctx: TrainContext) -> None:
    cfg, rollout = ctx.cfg, ctx.rollout
    ctx.call(rollout.start_producer)
    try:
        for step in range(ctx.start_step + 1, cfg.loop.num_steps + 1):
            timer = StepTimer()
            ctx.progress.phase("wait for data")
            with timer.span("wait_data"):
                groups, metrics = ctx.call(rollout.collect, cfg.rollout.prompts_per_step, cfg.loop.collect_timeout_s)
            train_on(ctx, step, groups, metrics, timer)
            push_weights(ctx, step, metrics, timer)
            # The engines were busy for the whole step (the producer never pauses).
            timer.add("perf/rollout_s", time.perf_counter() - timer.t0)
            end_step(ctx, step, metrics, timer)
    finally:
        ctx.call(rollout.stop_producer)
