"""Overlapped schedules end to end over real Ray, engine processes and a gloo trainer: groups are
trained at bounded staleness, weights keep flowing, and every drawn prompt is accounted for."""

import json

import pytest

from tests.helpers.runs import small_config

pytestmark = pytest.mark.e2e


def text_parity_reward(response: str, label) -> float:
    """A reward an untrained model earns about half the time, so groups carry a learning signal."""
    return float(len(response) % 2)


def records_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fully_async_trains_within_the_staleness_bound_with_off_policy_correction(tiny_model_dir, tmp_path, ray_cluster):
    from miles.orchestration.driver import run_train

    cfg = small_config(tiny_model_dir, tmp_path, **{
        "run.name": "async", "loop.schedule": "fully_async", "loop.num_steps": "4", "eval.every_steps": "0",
        "buffer.max_staleness": "1", "buffer.max_inflight_groups": "8", "buffer.filter": "none",
        "rollout.max_new_tokens": "6", "trainer.algorithm.tis_mode": "truncate",
        "rollout.reward": "tests.e2e.test_async:text_parity_reward",
        # Pushes pause the engines and abort what is in flight; those samples resume from their prefix.
        "loop.pause_mode": "abort", "rollout.partial_rollout": "true"})
    summary = run_train(cfg)
    records = records_of(tmp_path / "async")
    steps = records[1:]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        # buffer.filter = "none": every collected group trains, equal rewards (zero advantages) included;
        # nothing past the buffer drops a group.
        assert r["buffer/groups_trained"] == 4  # prompts_per_step
        assert r["buffer/samples_trained"] == 16  # × n_samples_per_prompt
        assert "buffer/groups_discarded_zero_std" not in r
        assert r["buffer/staleness_max"] <= 1
        assert r["step"] - 1 - r["rollout/weight_version"] <= 1  # oldest trained weights vs the policy
        # Off-policy correction ran and reported (an all on-policy step gives 1 up to float32 rounding).
        assert 0 < r["train/tis_ess"] <= 1 + 1e-6
    # The engines kept receiving weights while generating: later steps train on newer versions.
    assert steps[-1]["rollout/weight_version"] >= 1
    ledger = summary["ledger"]
    # The ledger is exact: what it calls trained is what the trainer trained.
    assert ledger["trained"] == sum(r["buffer/groups_trained"] for r in steps) == 16
    assert ledger["drawn"] == ledger["trained"] + ledger["discarded"] + ledger["pending"]


def test_one_step_off_trains_each_batch_one_version_behind_at_most(tiny_model_dir, tmp_path, ray_cluster):
    from miles.orchestration.driver import run_train

    cfg = small_config(tiny_model_dir, tmp_path, **{"run.name": "osd", "loop.schedule": "one_step_off",
                                                    "loop.num_steps": "3", "eval.every_steps": "0"})
    summary = run_train(cfg)
    steps = records_of(tmp_path / "osd")[1:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["buffer/staleness_max"] <= 1 for r in steps)
    # Batch 2 was generated while step 1 trained, so it started under version 0.
    assert steps[1]["rollout/weight_version"] == 0
    assert summary["ledger"]["pending"] == 0
