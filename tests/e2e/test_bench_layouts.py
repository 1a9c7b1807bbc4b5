"""`miles bench layouts`, smoke-sized: every layout trains the same step and the JSON says what each computed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_run_times_every_layout_and_counts_the_tokens_each_computes():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "miles.cli", "bench", "layouts", "--workloads", "short",
                           "--threads", "1", "--rounds", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = json.loads(done.stdout.splitlines()[-1])
    short = line["workloads"]["short"]
    assert list(line["workloads"]) == ["short"] and short["sequences"] == 256
    # 256 sequences of 7-9 prompt tokens and 6 response tokens: packed computes every token once,
    # shared each prompt once and each row from its prompt's last token (7 tokens), padded pads.
    assert short["computed_tokens"]["packed"] == short["tokens"]
    assert short["computed_tokens"]["shared"] < short["tokens"] < short["computed_tokens"]["padded"]
    timed = short["threads_1"]
    assert set(timed["median_s"]) == {"shared", "padded", "packed", "packed_mask"}
    assert all(len(v) == 1 and v[0] > 0 for v in timed["runs_s"].values())
    assert timed["mask_over_packed"] == timed["median_s"]["packed_mask"] / timed["median_s"]["packed"]


def test_bad_arguments_are_refused_by_name():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "miles.cli", "bench", "layouts", "--workloads", "medium"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--workloads: choose from long, short" in done.stderr
