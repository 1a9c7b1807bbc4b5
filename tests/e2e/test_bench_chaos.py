"""`miles bench chaos --quick`: one fault of every kind that kills (engine, reward worker, trainer rank,
router, and the driver, resumed by `miles train --resume`), an engine stalled for good and one
stalled past a push's deadline, and a damaged disk delta, in an 8-step fully_async disk-delta run on
the tiny model; the run completes, its ledger shows nothing lost and nothing trained twice, and
every push fault ends in a rollback and a retry (or a push without the failed engine) within the
push's deadlines, checksum-verified."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_kind_of_process_killed_once_and_nothing_is_lost(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "miles.cli", "bench", "chaos", "--quick", "--steps", "8",
                           "--kills-per-kind", "1", "--driver-kill-at", "2", "--stalls", "2", "--corrupt-deltas", "1",
                           "--push-deadline-s", "5", "--stall-resume-s", "12", "--commit-stalls", "0",
                           "--no-baseline", "--timeout", "900", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    log = (tmp_path / "chaos.log").read_text()[-6000:]
    assert line["plan"] == {"engine": [4], "trainer": [5], "reward_worker": [6], "router": [7], "driver": [2],
                            "corrupt_delta": [5], "stall": [6, 7], "stall_resume_s": [0.0, 12.0], "stall_commit": []}
    assert line["by_kind"] == {"engine": 1, "reward_worker": 1, "trainer": 1, "router": 1, "driver": 1,
                               "stall": 2, "corrupt_delta": 1}, log
    assert line["kills"] == 5
    assert line["run_completed"] and line["steps_recorded"] == 8, log
    assert line["prompts_lost"] == 0 and line["prompts_trained_twice"] == 0, line["ledger"]
    assert line["hung_pushes"] == 0 and line["hung_runs"] == 0
    assert line["off_fleet_samples"] == 0
    # The router outlived the killed driver's process group, the resumed driver adopted it, and no
    # router was left running once the runs ended.
    assert line["router_outlived_driver"] and line["router_adopted"] and line["routers_left_running"] == 0, log
    # The damaged delta: rolled back and retried; the stall that never ends: its engine is declared dead
    # and the version pushed again to the rest; the resumed stall: rolled back and retried, or, when
    # the push began by reconnecting to a changed fleet, waited out by reconnect retries. Each push
    # checksum-verified.
    assert line["push_faults_recovered"] == 3 and line["pushes_unverified"] == 0, line
    assert line["rollbacks"] >= 1 and line["engine_loss_retries"] >= 1, line
    assert line["rollbacks"] + line["reconnect_retries"] >= 2, line
    # The killed engine and the one stalled for good were replaced.
    assert line["engines_recovered"] == 2 and line["trainer_restarts"] == 1
    assert line["router_restarts"] == 1 and line["reward_worker_restarts"] == 1
    assert 0.0 <= line["eval_accuracy"] <= 1.0
    # One save a step (loop.save_every = 1) from the resumed driver's first step on, and the final one.
    saves = line["checkpoints"]
    assert saves["saves"] == 8 - 2 + 1 and saves["mean_save_s"] > 0 and saves["save_share_of_step"] > 0


def test_the_plan_puts_push_faults_on_kill_steps_and_counts_one_only_when_its_push_recovered():
    sys.path.insert(0, str(ROOT))
    from benchmarks.chaos import kill_plan, push_figures, push_plan

    kills = kill_plan(40, 3, 2)
    assert kills == {"engine": [4, 8, 12], "trainer": [5, 9, 13], "reward_worker": [6, 10, 14], "router": [7, 11, 15]}
    pushes = push_plan(kills, stalls=4, corrupt=2, resume_s=12.0)
    assert pushes == {"corrupt_delta": [5, 7], "stall": [6, 9, 10, 11], "stall_resume_s": [0.0, 12.0, 0.0, 12.0],
                      "stall_commit": []}
    with_commit = push_plan(kills, stalls=2, corrupt=1, resume_s=12.0, commit_stalls=1)
    assert len(with_commit["stall_commit"]) == 1 and not set(with_commit["stall_commit"]) & set(with_commit["stall"])
    with pytest.raises(SystemExit, match="raise --kills-per-kind or --steps"):
        push_plan(kill_plan(8, 1, 2), stalls=3, corrupt=1, resume_s=12.0)
    recs = [{"step": 5, "sync/total_s": 1.0, "sync/rollbacks": 1, "sync/verified_buckets": 3},
            {"step": 6, "sync/total_s": 1.0, "sync/engine_loss_retries": 1, "sync/verified_buckets": 3},
            {"step": 7, "sync/total_s": 1.0, "sync/verified_buckets": 3},           # no rollback: not recovered
            {"step": 9, "sync/total_s": 1.0, "sync/rollbacks": 1}]                  # not verified
    figures = push_figures(recs, pushes)
    assert figures == {"push_faults_recovered": 2, "rollbacks": 2, "engine_loss_retries": 1, "reconnect_retries": 0,
                       "pushes_unverified": 1, "fenced_engines": 0, "off_fleet_samples": 0}
    recs[1]["rollout/off_fleet_samples"] = 2.0
    assert push_figures(recs, pushes)["off_fleet_samples"] == 2
    recs[2]["sync/reconnect_retries"] = 1  # step 7's push waited for the stalled engine to answer again
    assert push_figures(recs, pushes)["push_faults_recovered"] == 3
