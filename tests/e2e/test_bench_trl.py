"""`miles bench trl --quick` end to end: TRL's GRPOTrainer and miles (sync, fully_async) train the same
job from the same checkpoint, and the last line carries every figure docs/benchmarks.md quotes.
The long workload alone is run: it takes every step the short one does (TRL, both miles schedules,
the eval of each checkpoint), and its own supervised format step and reward file besides."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"trl_samples_per_s", "miles_sync_samples_per_s", "miles_fully_async_samples_per_s", "ratio",
        "best_schedule", "best_ratio", "trl_eval_accuracy", "miles_eval_accuracy", "eval_gap_points"}


def bench(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "miles.cli", "bench", "trl", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_quick_run_reports_both_workloads_side_by_side(tiny_model_dir, tmp_path):
    done = bench("--quick", "--workloads", "long", "--sft-model", tiny_model_dir, "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["trl_version"] == "1.16.0"
    assert line["eval_prompts"] == 8  # --quick: 8 distinct held-out problems
    assert 0.0 <= line["long"]["start_eval_accuracy"] <= 1.0
    assert line["unmatched_settings"] and all(isinstance(s, str) for s in line["unmatched_settings"])
    # --quick keeps zero-variance groups in miles too, so that setting moves to the matched list.
    assert any("zero-variance" in s for s in line["matched_settings"])
    assert not any("zero-variance" in s for s in line["unmatched_settings"])
    assert "short" not in line  # only the workloads asked for run
    for name, new_tokens in (("long", 16),):
        w = line[name]
        assert KEYS <= set(w), name
        assert w["settings"]["max_new_tokens"] == new_tokens
        for c in ("trl_samples_per_s", "miles_sync_samples_per_s", "miles_fully_async_samples_per_s"):
            assert w[c] > 0, (name, c)
        assert w["ratio"] == pytest.approx(w["miles_fully_async_samples_per_s"] / w["trl_samples_per_s"])
        # The best schedule is the faster one, and its eval is the one set against TRL's.
        best = max(("sync", "fully_async"), key=lambda s: w[f"miles_{s}_samples_per_s"])
        assert w["best_schedule"] == best
        assert w["best_ratio"] == pytest.approx(w[f"miles_{best}_samples_per_s"] / w["trl_samples_per_s"])
        assert w["miles_eval_accuracy"] == w["runs"][f"miles_{best}"]["eval_accuracy"]
        assert 0.0 <= w["trl_eval_accuracy"] <= 1.0 and 0.0 <= w["miles_eval_accuracy"] <= 1.0
        assert w["eval_gap_points"] == pytest.approx(100 * (w["trl_eval_accuracy"] - w["miles_eval_accuracy"]))
        # Each side ran the workload's steps: TRL's step clock and miles' metrics agree on the count.
        assert {c: len(r["step_s"]) for c, r in w["runs"].items()} == {
            "trl": w["settings"]["steps"], "miles_sync": w["settings"]["steps"],
            "miles_fully_async": w["settings"]["steps"]}
    # The long workload's reward is the one file both sides load.
    assert line["long"]["settings"]["reward"].endswith("_answer_first.py:answer_first")


def test_unknown_workload_is_refused_with_the_choices():
    done = bench("--workloads", "short,huge", timeout=120)
    assert done.returncode != 0
    assert "--workloads" in done.stderr and "short, long" in done.stderr
