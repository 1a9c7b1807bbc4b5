"""The decoupled PPO objective in a real fully_async run (Ray, engine processes, a gloo trainer):
stale groups train, and the step reports the objective's behaviour weights and clip causes."""

import json
import math

import pytest

from tests.helpers.runs import small_config

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_fully_async_trains_stale_groups_with_decoupled_ppo(tiny_model_dir, tmp_path, ray_cluster):
    from miles.orchestration.driver import run_train

    cfg = small_config(tiny_model_dir, tmp_path, **{
        "run.name": "decoupled", "loop.schedule": "fully_async", "loop.num_steps": "3", "eval.every_steps": "0",
        "buffer.max_staleness": "2", "buffer.max_inflight_groups": "8", "buffer.filter": "none",
        "rollout.max_new_tokens": "6", "trainer.algorithm.name": "decoupled_ppo",
        "trainer.algorithm.behav_weight_cap": "5.0",
        "rollout.reward": "tests.e2e.test_async:text_parity_reward"})
    run_train(cfg)
    records = [json.loads(line) for line in (tmp_path / "decoupled" / "metrics.jsonl").read_text().splitlines()]
    steps = records[1:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["buffer/staleness_max"] <= 2
        assert math.isfinite(r["train/loss"])
        # The objective's own metrics, under its prefix: w = π_prox/π_behav is near 1 for fresh samples
        # (train/engine numerics), the cumulative histogram ends at 1 by the last edge that holds every token.
        assert 0.5 < r["decoupled_ppo/behav_weight_mean"] < 2.0
        assert r["decoupled_ppo/clipped_frac_ratio"] == 0.0  # one update per batch: the clip never binds
        assert 0.0 <= r["decoupled_ppo/clipped_frac_weight_cap"] <= 1.0
        assert r["decoupled_ppo/behav_weight_le_0.5"] <= r["decoupled_ppo/behav_weight_le_2"] <= 1.0
        # The staleness histogram counts every trained group.
        hist = {k: v for k, v in r.items() if k.startswith("buffer/staleness/")}
        assert sum(hist.values()) == r["buffer/groups_trained"] == 4
    # Engines generated ahead of the trainer: some group trained at least one version old.
    assert any(r["buffer/staleness_max"] >= 1 for r in steps)
