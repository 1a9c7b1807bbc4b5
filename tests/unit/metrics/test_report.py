"""`miles report`: PNG plots and a markdown summary for one run, or two side by side."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.metrics.plots import PLOTS, render_png
from miles.metrics.report import main
from miles.metrics.run_data import load_run
from miles.metrics.sink import JsonlSink
from miles.metrics.timers import derive
from tests.helpers.runs import new_run


def make_run(path: Path, steps: int = 6, total: int | None = None, reward_slope: float = 0.05,
             stale: bool = False) -> Path:
    """A run directory as `miles train` leaves it: config.json, metrics.jsonl, summary.json."""
    sink = new_run(path, total or steps)
    sink.write(0, {"eval/accuracy": 0.2, "eval/num_prompts": 64})
    for k in range(1, steps + 1):
        m = {"rollout/reward_mean": 0.2 + reward_slope * k, "rollout/samples_per_s": 40.0, "rollout/tokens_per_s": 160.0,
             "rollout/zero_std_group_frac": 0.25, "rollout/truncated_frac": 0.0,
             "perf/rollout_s": 2.0, "perf/reward_s": 0.1, "perf/train_s": 1.2, "perf/train_forward_s": 0.4,
             "perf/train_backward_s": 0.6, "perf/train_optimizer_s": 0.1, "perf/sync_s": 0.3, "sync/total_s": 0.25,
             "sync/transport_s": 0.1, "sync/commit_s": 0.05, "perf/step_s": 3.6, "train/loss_tokens": 500.0,
             "buffer/groups_trained": 3, "buffer/groups_discarded_zero_std": 1,
             "buffer/staleness/0": 4 if not stale else 2}
        if stale:
            m["buffer/staleness/1"] = 2
        if k % 2 == 0:
            m.update({"eval/accuracy": 0.2 + 0.05 * k, "perf/eval_s": 0.4})
            m["perf/step_s"] += 0.4
        sink.write(k, derive(m))
    sink.close()
    if total is None:
        (path / "summary.json").write_text(json.dumps({"wall_time_s": 25.0, "steps": steps}))
    return path


def _png_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return im.size


def test_report_of_one_run_writes_plots_and_summary(tmp_path):
    run = make_run(tmp_path / "grpo")
    out = subprocess.run([sys.executable, "-m", "miles.cli", "report", str(run)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = run / "report"
    printed = out.stdout.split()
    for name in PLOTS:
        png = report / f"{name}.png"
        assert str(png) in printed
        w, h = _png_size(png)
        assert w >= 400 and h >= 300
    summary = (report / "summary.md").read_text()
    assert "| eval accuracy (first → last) | 0.200 → 0.500 |" in summary
    assert "| training steps recorded | 6 |" in summary
    assert "| buffer ledger (groups) | discarded_zero_std 6, trained 18 |" in summary
    assert "rollout " in summary.split("where step time went |")[1].splitlines()[0]
    assert "![step_time](step_time.png)" in summary
    assert "## Notes" not in summary  # a healthy finished run has nothing to warn about


def test_two_runs_side_by_side(tmp_path):
    a = make_run(tmp_path / "a" / "grpo")
    b = make_run(tmp_path / "b" / "grpo", reward_slope=0.01, stale=True)
    assert main([str(a), str(b)]) == 0
    report = a / "report-vs-grpo"
    summary = (report / "summary.md").read_text()
    # Same leaf name: the parents tell them apart.
    assert "| | a/grpo | b/grpo |" in summary
    assert "| staleness (mean / max versions) | 0.00 / 0 | 0.50 / 1 |" in summary
    for name in PLOTS:
        assert _png_size(report / f"{name}.png")[0] >= 400


def test_unfinished_and_unhealthy_runs_are_pointed_out(tmp_path):
    run = make_run(tmp_path / "long", steps=3, total=10)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rollout/rew')  # killed mid-write
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "3 of 10 (unfinished)" in summary
    assert "recorded 3 of 10 steps" in summary
    assert "torn last line" in summary


def test_bad_run_directories_get_a_clear_message(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "metrics.jsonl").write_text("")
    assert main([str(tmp_path / "fresh")]) == 2
    assert "no records yet" in capsys.readouterr().err


@pytest.mark.parametrize("plot", PLOTS)
def test_plots_of_a_run_without_those_metrics_still_render(tmp_path, plot):
    run = tmp_path / "bare"
    run.mkdir()
    JsonlSink(run / "metrics.jsonl").write(0, {"eval/accuracy": 0.3})
    assert render_png(plot, [load_run(run)]).startswith(b"\x89PNG")


def test_buffer_ledger_totals_and_heavy_discards_are_reported(tmp_path):
    run = tmp_path / "async"
    run.mkdir()
    sink = JsonlSink(run / "metrics.jsonl")
    for k in range(1, 4):
        # The data buffer reports running totals per prompt, with a reason for every discard.
        sink.write(k, derive({"perf/step_s": 2.0, "perf/wait_data_s": 0.5, "perf/train_s": 1.0,
                              "buffer/drawn": 10.0 * k, "buffer/trained": 3.0 * k, "buffer/pending": 1.0,
                              "buffer/discarded_filtered": 5.0 * k, "buffer/discarded_stale": 1.0 * k - 1,
                              "buffer/retried_failed": 1.0, "buffer/staleness_mean": 0.5, "buffer/staleness_max": 1.0}))
    sink.close()
    assert main([str(run)]) == 0
    summary = (run / "report" / "summary.md").read_text()
    assert ("| buffer ledger (groups) | drawn 30, trained 9, pending 1, discarded_filtered 15, discarded_stale 2, "
            "retried_failed 1 |") in summary
    assert "| staleness (mean / max versions) | 0.50 / 1 |" in summary
    assert "17 of 30 prompts drawn were discarded (filtered 15, stale 2)" in summary
    assert "wait for data" in summary.split("where step time went |")[1].splitlines()[0]
