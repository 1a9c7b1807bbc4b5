"""`miles bench scaling`, its pieces: the least-squares line every curve is fitted with, the curve and
summary lines it prints, the --quick sizes, and the simulated fully_async run on the real DataBuffer."""

import json

import pytest

from benchmarks import scaling as bench


def test_a_line_through_hand_worked_points_gives_its_intercept_and_slope():
    # y = 3 + 2x exactly: the fit recovers both and explains all of the spread.
    fit = bench.fit_line([[0, 3], [1, 5], [2, 7], [5, 13]], "MiB")
    assert fit["fixed"] == pytest.approx(3.0) and fit["per_unit"] == pytest.approx(2.0)
    assert fit["r2"] == pytest.approx(1.0) and fit["unit"] == "MiB"


def test_scattered_points_give_the_least_squares_line_and_its_r2():
    # Worked by hand: mean x 2, mean y 2; sxx 10, sxy 7 -> slope 0.7, intercept 2 - 1.4 = 0.6;
    # residuals -0.6, 0.7, 0.3, -0.4 -> ss_res 1.1 of ss_tot 6 -> r2 = 1 - 1.1/6.
    fit = bench.fit_line([(0, 0), (1, 2), (3, 3), (4, 3)], "token")
    assert fit["per_unit"] == pytest.approx(0.7) and fit["fixed"] == pytest.approx(0.6)
    assert fit["r2"] == pytest.approx(1 - 1.1 / 6)


def test_a_flat_series_is_a_perfect_flat_line():
    fit = bench.fit_line([(1, 2.0), (2, 2.0), (4, 2.0)], "sequence")
    assert (fit["fixed"], fit["per_unit"], fit["r2"]) == (pytest.approx(2.0), pytest.approx(0.0), 1.0)


@pytest.mark.parametrize("points", [[(1, 2.0)], [(3, 1.0), (3, 2.0)], []])
def test_a_line_needs_two_distinct_sizes_and_says_so(points):
    with pytest.raises(ValueError, match="measure more sizes"):
        bench.fit_line(points, "MiB")


def test_curves_and_the_summary_are_json_lines_of_the_documented_shape():
    sync = bench.curve("sync_broadcast", [(16.0, 0.5), (64.0, 1.1), (256.0, 3.5)], "MiB", y="s per push")
    speed = bench.curve("async_speedup", [(0.5, 1.5), (1.0, 2.0), (2.0, 1.5)], "overlap",
                        fit_points=[(0.5, 1.5), (1.0, 2.0), (0.5, 1.5)])
    line = json.loads(json.dumps(sync))
    assert line["curve"] == "sync_broadcast" and line["y"] == "s per push"
    assert line["points"] == [[16.0, 0.5], [64.0, 1.1], [256.0, 3.5]]
    assert set(line["fit"]) == {"fixed", "per_unit", "unit", "r2"}
    # The plotted x (rollout/train ratio) and the fitted x (overlap) differ: the fit is on the overlap,
    # where perfect overlap is the line 1 + overlap.
    assert speed["points"] == [[0.5, 1.5], [1.0, 2.0], [2.0, 1.5]]
    assert speed["fit"]["fixed"] == pytest.approx(1.0) and speed["fit"]["per_unit"] == pytest.approx(1.0)

    last = json.loads(json.dumps(bench.summary([sync, speed], quick=True, wall_s=12.5)))
    assert last["summary"] == "scaling" and last["quick"] is True and last["wall_s"] == 12.5
    assert last["fits"] == {"sync_broadcast": sync["fit"], "async_speedup": speed["fit"]}


def test_quick_sets_small_sizes_but_an_option_given_wins(capsys):
    a = bench.parse(["--quick", "--max-concurrency", "16"])
    assert a.max_concurrency == 16 and a.sync_mib == bench.QUICK["sync_mib"]
    assert bench.parse([]).max_concurrency == 512
    for argv, named in ((["--only", "rollout,gpu"], "--only"), (["--sync-mib", "8,8"], "--sync-mib"),
                        (["--async-ratios", "0,1"], "--async-ratios")):
        with pytest.raises(SystemExit):
            bench.parse(argv)
        assert named in capsys.readouterr().err


def test_simulated_fully_async_overlaps_rollout_and_training_on_the_real_buffer():
    # rollout 0.1 s and training 0.1 s per step: in turn 6 x 0.2 s; overlapped about 6 x 0.1 s plus the
    # first rollout. Nothing is generated only to be dropped as too stale.
    wall, dropped = bench._simulated_fully_async(0.1, 0.1, pps=2, steps=6, max_staleness=2)
    assert dropped == 0
    assert 0.6 <= wall < 1.15  # in turn: 1.2 s


def test_plot_draws_one_png_per_curve_from_saved_runs_and_refuses_a_file_without_curves(tmp_path):
    def run(slope: float) -> str:
        lines = ["[bench scaling] log lines are skipped",
                 json.dumps({"curve": "sync_p2p", "points": [[16, 0.01], [256, 0.1]], "y": "s per push",
                             "fit": bench.fit_line([[16, 0.01], [256, 0.1 * slope]], "MiB")}),
                 json.dumps({"curve": "async_speedup", "points": [[0.5, 1.5], [1, 1.9], [2, 1.5]], "y": "speedup",
                             "x": "rollout_s / train_s", "fit": bench.fit_line([[0.5, 1.5], [1, 1.9]], "overlap")})]
        path = tmp_path / f"run{slope}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    written = bench.plot([run(1.0), run(1.2)], str(tmp_path / "plots"))
    assert [p.name for p in written] == ["scaling_sync_p2p.png", "scaling_async_speedup.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000 for p in written)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("nothing here\n")
    with pytest.raises(ValueError, match="no curve lines"):
        bench.plot([str(empty)], str(tmp_path / "none"))
