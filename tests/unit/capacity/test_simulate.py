"""`miles simulate`: a table and one JSON line, from a run config and a fleet."""

from __future__ import annotations

import json

import pytest

from miles.capacity.simulate import main


def test_simulate_prints_a_table_and_a_json_line_from_the_run_config(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[model]\npath = "/nowhere/glm-5"\n[rollout]\nmax_new_tokens = 8192\n'
                      '[loop]\nschedule = "fully_async"\n[sync]\ntransport = "p2p"\n')
    assert main([str(config), "--model-size", "744B", "--gpus", "64", "--device", "gb300",
                 "--trainer.offload_optimizer", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert "weight sync per transport:" in lines
    assert out["model"] == "glm-5-744b" and out["devices"] == 64 and out["fits"]
    assert set(out["sync_by_transport"]) == {"broadcast", "p2p", "disk_delta", "disk"}
    assert out["sync_s"] == out["sync_by_transport"]["p2p"]["seconds"]  # the config's transport
    # fully_async overlaps rollout with train + sync: the step is the slower side, not the sum.
    assert out["step_s"] == pytest.approx(max(out["rollout_s"], out["train_s"] + out["sync_s"]))


def test_simulate_without_a_model_size_or_calibration_names_the_flag():
    with pytest.raises(SystemExit, match="--model-size"):
        main(["--gpus", "64"])
    with pytest.raises(SystemExit, match="--calibrate"):
        main(["--device", "cpu"])
    with pytest.raises(SystemExit, match="744B"):
        main(["--model-size", "big"])


def test_simulate_on_this_host_projects_the_sync_benchmark_from_a_bench_line(capsys, tmp_path):
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"bytes": 100_000_000, "engines": 2, "raw_gloo_broadcast_s": 0.2,
                                 "memcpy_s": 0.05, "broadcast_efficiency": 0.5, "p2p_vs_copy_limit": 1.5}) + "\n")
    assert main(["--device", "cpu", "--calibrate-from", str(bench), "--model-size", "100M"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    projected = out["projected_bench_sync"]
    # 200 MB (100M bf16 parameters) is twice the calibrated push: every figure doubles.
    assert projected["raw_gloo_broadcast_s"] == pytest.approx(0.4)
    assert projected["broadcast_s"] == pytest.approx(0.8)
    assert projected["p2p_s"] == pytest.approx(2 * 0.1 * 1.5)  # each engine's 200 MB copied once, x p2p over copy


def test_simulate_checks_its_projection_against_the_benchs_second_model(capsys, tmp_path):
    def line(nbytes, p2p):
        runs = {"broadcast": [0.4 * nbytes / 1e8] * 3, "raw": [0.2 * nbytes / 1e8] * 3, "p2p": [p2p] * 3,
                "memcpy": [0.05 * nbytes / 1e8] * 3}
        return {"bytes": nbytes, "engines": 2, "raw_gloo_broadcast_s": runs["raw"][0], "memcpy_s": runs["memcpy"][0],
                "raw_runs": runs}
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({**line(100_000_000, 0.1), "second": line(200_000_000, 0.4)}) + "\n")
    assert main(["--device", "cpu", "--calibrate-from", str(bench)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    check = json.loads(lines[-1])["check_second_model"]
    assert check == {"broadcast_s": 1.0, "p2p_s": 0.5, "raw_gloo_broadcast_s": 1.0, "memcpy_s": 1.0}
    # p2p took twice what its bytes explain: the table says so.
    assert [row.split()[0] for row in lines if "off by more than 20%" in row] == ["p2p_s"]
