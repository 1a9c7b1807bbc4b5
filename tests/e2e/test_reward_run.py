"""A short run with a user reward file (written here, named by its path in the run config) in which
one call raises and one hangs: both are counted, their samples get the fallback, the run completes."""

import json
import textwrap

import pytest

from tests.helpers.runs import small_config

pytestmark = pytest.mark.e2e

REWARD = '''
import time

CALLS = 0

def flaky_digits(sample):
    global CALLS
    CALLS += 1
    if CALLS == 10:
        raise RuntimeError("the user's reward failed once")
    if CALLS == 11:
        time.sleep(3)
    digits = sum(c.isdigit() for c in sample.response)
    return {"score": digits / max(len(sample.response), 1), "digits": digits}
'''


@pytest.mark.slow
def test_run_with_a_failing_user_reward_completes_and_counts_the_failures(tiny_model_dir, tmp_path, ray_cluster):
    from miles.orchestration.driver import run_train

    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(textwrap.dedent(REWARD))
    cfg = small_config(tiny_model_dir, tmp_path, **{
        "loop.num_steps": "2", "eval.num_prompts": "4", "rollout.temperature": "1.5",
        "rollout.reward": f"{reward_file}:flaky_digits", "rollout.reward_config.timeout_s": "1",
        "rollout.reward_config.fallback_score": "0"})
    run_train(cfg)
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r.get("reward/errors", 0) for r in records) == 1
    assert sum(r.get("reward/timeouts", 0) for r in records) == 1
    # 4 prompts x 4 samples per step; the evaluations (4 prompts, before RL and at step 2) are not counted.
    assert all("reward/digits" in r and r["reward/calls"] == 16 for r in steps)
