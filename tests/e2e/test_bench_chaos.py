"""`miles bench chaos`, small: one kill of every kind (engine, reward worker, trainer rank, router,
and the driver, resumed by `miles train --resume`) in an 8-step fully_async disk-delta run; the
run completes and its ledger shows nothing lost and nothing trained twice."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_every_kind_of_process_killed_once_and_nothing_is_lost(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "miles.cli", "bench", "chaos", "--steps", "8",
                           "--kills-per-kind", "1", "--driver-kill-at", "2", "--no-baseline", "--timeout", "900",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    log = (tmp_path / "chaos.log").read_text()[-6000:]
    assert line["plan"] == {"engine": [4], "trainer": [5], "reward_worker": [6], "router": [7], "driver": [2]}
    assert line["by_kind"] == {"engine": 1, "reward_worker": 1, "trainer": 1, "router": 1, "driver": 1}, log
    assert line["kills"] == 5
    assert line["run_completed"] and line["steps_recorded"] == 8, log
    assert line["prompts_lost"] == 0 and line["prompts_trained_twice"] == 0, line["ledger"]
    assert line["hung_pushes"] == 0 and line["hung_runs"] == 0
    assert line["engines_recovered"] == 1 and line["trainer_restarts"] == 1
    assert line["router_restarts"] == 1 and line["reward_worker_restarts"] == 1
    assert 0.0 <= line["eval_accuracy"] <= 1.0
    # One save a step (loop.save_every = 1) from the resumed driver's first step on, and the final one.
    saves = line["checkpoints"]
    assert saves["saves"] == 8 - 2 + 1 and saves["mean_save_s"] > 0 and saves["save_share_of_step"] > 0
