"""Per-step timing breakdown and the derived goodput and idle figures."""

import time

import pytest

from miles.buffer.types import Group, Sample
from miles.metrics.timers import StepTimer, breakdown, derive, staleness_counts


def test_spans_add_up_and_derived_figures_follow():
    timer = StepTimer()
    with timer.span("rollout"):
        time.sleep(0.05)
    with timer.span("train"):
        time.sleep(0.02)
    with timer.span("train"):  # a second span of one name adds to it
        time.sleep(0.02)
    m = timer.finish({"train/loss_tokens": 400.0})
    assert m["perf/rollout_s"] >= 0.05 and m["perf/train_s"] >= 0.04
    assert m["perf/step_s"] >= m["perf/rollout_s"] + m["perf/train_s"]
    assert m["perf/goodput_tokens_per_s"] == pytest.approx(400.0 / m["perf/step_s"])
    # The engines generated during the rollout only; the trainer worked during train only.
    assert m["perf/engine_idle_frac"] == pytest.approx(1 - m["perf/rollout_s"] / m["perf/step_s"])
    assert m["perf/trainer_idle_frac"] == pytest.approx(1 - m["perf/train_s"] / m["perf/step_s"])


def test_breakdown_is_disjoint_and_sums_to_the_step_time():
    rec = derive({"perf/step_s": 10.0, "perf/rollout_s": 4.0, "perf/reward_s": 0.5, "perf/train_s": 3.0,
                  "perf/train_forward_s": 1.0, "perf/train_backward_s": 1.5, "perf/train_optimizer_s": 0.2,
                  "perf/sync_s": 1.0, "sync/total_s": 0.9, "sync/transport_s": 0.4, "sync/commit_s": 0.1,
                  "perf/eval_s": 1.5})
    assert rec["sync/prepare_s"] == pytest.approx(0.4) and rec["sync/apply_s"] == pytest.approx(0.1)
    parts = breakdown(rec)
    assert sum(parts.values()) == pytest.approx(10.0)
    assert parts["rollout"] == pytest.approx(3.5) and parts["reward"] == pytest.approx(0.5)
    assert parts["train other"] == pytest.approx(0.3)
    assert parts["sync other"] == pytest.approx(0.1)
    assert parts["other"] == pytest.approx(0.5)


def test_staleness_counts_groups_by_versions_behind():
    def group(versions):
        return Group(samples=[Sample([1], [2], [0.0], [1], weight_versions=[v]) for v in versions])

    counts = staleness_counts([group([5, 5]), group([4, 5]), group([3]), group([5])], policy_version=5)
    assert counts == {"buffer/staleness/0": 2, "buffer/staleness/1": 1, "buffer/staleness/2": 1}


def test_overlapped_generation_shows_as_the_trainers_wait_not_as_rollout_time():
    # fully_async / one_step_off: engines generated all step long, the trainer waited 0.5 s of it.
    rec = derive({"perf/step_s": 4.0, "perf/rollout_s": 4.0, "perf/wait_data_s": 0.5, "perf/reward_s": 0.2,
                  "perf/train_s": 2.5, "perf/sync_s": 0.8})
    parts = breakdown(rec)
    assert "rollout" not in parts and parts["wait for data"] == 0.5
    assert sum(parts.values()) == pytest.approx(4.0)
    assert rec["perf/engine_idle_frac"] == 0.0
