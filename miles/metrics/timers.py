"""Per-step timing: where a step's wall time went, and what it bought.

The loop times its own parts with `StepTimer.span(...)`; components report their inner parts in
their metrics (the trainer: `perf/train_forward_s`, `perf/train_backward_s`,
`perf/train_optimizer_s`; weight sync: `sync/transport_s`, `sync/commit_s`, `sync/total_s`, and
`sync/verify_s` where verification runs; rollout: `perf/reward_s`). `finish` adds the derived
figures:

    perf/step_s                 wall time of the step
    perf/goodput_tokens_per_s   loss tokens that reached the gradient / step time
    perf/trainer_idle_frac      share of the step the trainer was not training or syncing
    perf/engine_idle_frac       share of the step the engines were not generating (rollout, eval)
    perf/wait_data_s            time the trainer waited for data (the loop reports it)
    sync/prepare_s, sync/apply_s  the gather/convert share and the engines' commit share of a sync

`breakdown(record)` splits one record into disjoint parts that add up to the step time, which is
what the stacked step-time plot shows. Non-goal: profiling inside a part (use torch.profiler).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

# Loop spans that keep the engines busy / the trainer busy. In overlapped schedules each side's
# busy time is what that side reports, so the fractions stay meaningful there too.
ENGINE_BUSY = ("perf/rollout_s", "perf/eval_s")
TRAINER_BUSY = ("perf/train_s", "perf/sync_s")


class StepTimer:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.spans: dict[str, float] = {}

    @contextmanager
    def span(self, name: str):
        """Time a part of the step as `perf/<name>_s` (repeated spans of one name add up)."""
        s = time.perf_counter()
        try:
            yield
        finally:
            self.add(f"perf/{name}_s", time.perf_counter() - s)

    def add(self, key: str, seconds: float) -> None:
        self.spans[key] = self.spans.get(key, 0.0) + seconds

    def finish(self, metrics: dict) -> dict:
        """The step's spans plus derived figures, merged over `metrics` (returned as a new dict)."""
        out = dict(metrics)
        out.update(self.spans)
        out.setdefault("perf/step_s", time.perf_counter() - self.t0)
        return derive(out)


def derive(m: dict) -> dict:
    """Add derived timing figures to a step record (missing inputs count as zero)."""
    out = dict(m)
    step = out.get("perf/step_s") or 0.0
    if "sync/total_s" in out:
        inner = sum(out.get(k) or 0.0 for k in ("sync/transport_s", "sync/commit_s", "sync/verify_s"))
        out.setdefault("sync/prepare_s", max(0.0, out["sync/total_s"] - inner))
        out.setdefault("sync/apply_s", out.get("sync/commit_s") or 0.0)
    if step > 0:
        engine_busy = sum(out.get(k) or 0.0 for k in ENGINE_BUSY)
        trainer_busy = sum(out.get(k) or 0.0 for k in TRAINER_BUSY)
        out.setdefault("perf/engine_idle_frac", _frac(1.0 - engine_busy / step))
        out.setdefault("perf/trainer_idle_frac", _frac(1.0 - trainer_busy / step))
        out.setdefault("perf/goodput_tokens_per_s", (out.get("train/loss_tokens") or 0.0) / step)
    return out


def _frac(x: float) -> float:
    return min(1.0, max(0.0, x))


# The stacked step-time plot: (label, how to get its seconds from a record). Sub-parts are shown
# where the component reported them; whatever is left of the parent shows as "... other".
def breakdown(m: dict) -> dict[str, float]:
    """Disjoint parts of one step that add up to perf/step_s (the remainder is 'other')."""
    g = lambda k: m.get(k) or 0.0  # noqa: E731
    parts: dict[str, float] = {}
    rollout, wait = m.get("perf/rollout_s"), m.get("perf/wait_data_s")
    if rollout is not None and (wait is None or rollout <= wait + 1e-6):
        # The trainer waited for the whole collection (sync schedule): generation is part of the step.
        parts["rollout"] = max(0.0, g("perf/rollout_s") - g("perf/reward_s"))
        parts["reward"] = g("perf/reward_s")
    elif wait is not None:
        # Generation overlapped training: only the time the trainer actually waited is the step's.
        parts["wait for data"] = wait
    train_parts = {"train forward": g("perf/train_forward_s"), "train backward": g("perf/train_backward_s"),
                   "train optimizer": g("perf/train_optimizer_s")}
    parts.update(train_parts)
    parts["train other"] = max(0.0, g("perf/train_s") - sum(train_parts.values()))
    sync_parts = {"sync prepare": g("sync/prepare_s"), "sync transport": g("sync/transport_s"),
                  "sync apply": g("sync/apply_s"), "sync verify": g("sync/verify_s")}
    parts.update(sync_parts)
    parts["sync other"] = max(0.0, g("perf/sync_s") - sum(sync_parts.values()))
    parts["eval"] = g("perf/eval_s")
    parts["other"] = max(0.0, g("perf/step_s") - sum(parts.values()))
    return parts


def staleness_counts(groups, policy_version: int) -> dict[str, float]:
    """`buffer/staleness/<k>`: how many of the trained groups were k policy versions old."""
    counts: dict[str, float] = {}
    for g in groups:
        k = max(0, policy_version - g.oldest_weight_version)
        key = f"buffer/staleness/{k}"
        counts[key] = counts.get(key, 0.0) + 1
    return counts
