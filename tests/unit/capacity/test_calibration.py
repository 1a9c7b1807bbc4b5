"""The CPU side: constants calibrated from this host's own sync benchmark project that benchmark.

The calibration and the check come from one fresh measurement (the benchmark's bare gloo broadcast to
long-lived receivers and its memcpy): constants from a one-bucket model, projected onto a
two-bucket model measured in the same rounds, so a busy machine slows both alike. The full benchmark's
own check (a second model timed in the same rounds) is computed round by round and names what misses."""

from __future__ import annotations

import json
import statistics

import pytest

from miles.capacity import calibration
from miles.config.loader import ConfigError

FIGURES = ("raw_gloo_broadcast_s", "memcpy_s")


def _median_ratios(rounds) -> dict[str, float]:
    ratios = {k: [] for k in FIGURES}
    for one, many in rounds:
        projected = calibration.project_bench(calibration.from_bench(one), many["bytes"], many["engines"])
        for k in FIGURES:
            ratios[k].append(projected[k] / many[k])
    return {k: statistics.median(v) for k, v in ratios.items()}


def test_projection_of_the_sync_benchmark_is_within_20_percent_of_a_fresh_measurement():
    ratios = _median_ratios(calibration.measure())
    if any(abs(r - 1) > 0.2 for r in ratios.values()):
        # A neighbour's burst can land on one side of most rounds; one more measurement decides.
        ratios = _median_ratios(calibration.measure())
    assert all(abs(r - 1) <= 0.2 for r in ratios.values()), ratios


# The last line of `miles bench sync --layers 1 --repeats 3 --steps 0 --bucket-mb 32` on this host.
BENCH_LINE = json.dumps({
    "bytes": 92281088, "bucket_mb": 32, "engines": 2, "repeats": 3, "broadcast_s": 0.3855,
    "raw_gloo_broadcast_s": 0.1251, "memcpy_s": 0.0458, "broadcast_efficiency": 0.324, "p2p_s": 0.1549,
    "p2p_speedup_vs_broadcast": 2.489, "p2p_vs_copy_limit": 1.69, "colocated_s": 0.501, "delta_density": 0.0})


def test_a_bench_line_calibrates_every_transport_the_bench_measures(tmp_path):
    path = tmp_path / "bench.jsonl"
    path.write_text("model: 88 MiB of bf16 weights\n" + BENCH_LINE + "\n")
    cal = calibration.read_bench_file(str(path))
    same = calibration.project_bench(cal, 92281088, 2)
    # Read back at the measured size, the projection is the measurement (the constants are its ratios).
    for k, v in json.loads(BENCH_LINE).items():
        if k in same:
            assert same[k] == pytest.approx(v, rel=0.02), k
    double = calibration.project_bench(cal, 2 * 92281088, 2)
    assert double["broadcast_s"] == pytest.approx(2 * same["broadcast_s"])


def test_a_line_that_is_not_a_sync_bench_line_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="memcpy_s"):
        calibration.from_bench(json.dumps({"bytes": 1, "engines": 2, "raw_gloo_broadcast_s": 1.0}))
    with pytest.raises(ConfigError, match="miles bench sync"):
        calibration.read_bench_file(str(tmp_path / "missing.jsonl"))


def _bench_line(nbytes: int, rounds: dict[str, list[float]]) -> dict:
    return {"bytes": nbytes, "engines": 2, "raw_gloo_broadcast_s": 0.0, "memcpy_s": 0.0, "raw_runs": rounds}


def test_the_check_calibrates_each_round_on_the_first_model_and_names_a_figure_that_does_not_scale():
    # Every round is slower than the last (a neighbour's load rising), alike for both models: the
    # second model is twice the bytes, and its p2p time carries a fixed cost that bytes do not explain.
    load = [1.0, 3.0, 2.0, 5.0, 4.0]
    first = {"broadcast": [0.4 * x for x in load], "raw": [0.2 * x for x in load], "p2p": [0.1 * x for x in load],
             "memcpy": [0.05 * x for x in load]}
    second = {k: [2 * v for v in vs] for k, vs in first.items()}
    second["p2p"] = [0.1 * x + 0.3 for x in load]  # 0.1 s per 100 MB plus 0.3 s whatever the size
    line = {**_bench_line(100_000_000, first), "second": _bench_line(200_000_000, second)}
    check = calibration.check_projection(line)
    assert {k: check[k] for k in ("broadcast_s", "raw_gloo_broadcast_s", "memcpy_s")} == {
        "broadcast_s": 1.0, "raw_gloo_broadcast_s": 1.0, "memcpy_s": 1.0}
    assert check["p2p_s"] == pytest.approx(statistics.median(0.2 * x / (0.1 * x + 0.3) for x in load), abs=1e-3)
    with pytest.raises(ConfigError, match="--second-layers"):
        calibration.check_projection(_bench_line(100_000_000, first))
