"""`miles bench gpu` runs on CPU at small sizes (the CI smoke of the GPU benchmark): its JSON line carries
every figure docs/benchmarks.md quotes, the engine's side of the decode comparison (its fast path)
decodes exactly the tokens it was asked for, and each batch's decode step is taken apart."""

import json

from benchmarks import gpu as bench


def test_the_cpu_smoke_prints_one_line_with_decode_floor_and_trainer_figures(capsys):
    assert bench.main(["--device", "cpu", "--batches", "2", "--new-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "gpu" and out["copy_gb_s"] > 0
    (row,) = out["decode"]
    assert row["batch"] == 2 and row["new_tokens"] == 4
    assert row["decode_steps"] == 3  # the first token comes from the prefill, then one step per token
    assert row["hf_tokens_per_s"] > 0 and row["miles_tokens_per_s"] > 0 and row["floor_ms"] > 0
    assert row["step_over_floor"] >= 1  # a step can never beat reading the weights once
    assert row["engine"] == "fast"
    parts = row["breakdown"]
    assert not parts["graphs"]  # cpu: the same padded forward, run eagerly
    assert min(parts["step_ms"], parts["forward_ms"], parts["forward_eager_ms"], parts["sampling_ms"]) > 0
    assert set(parts["eager_kernels"]) == {"attention_ms", "matmul_ms", "other_ms"}
    assert parts["eager_kernels"]["matmul_ms"] > 0 and parts["eager_kernels"]["attention_ms"] > 0
    assert parts["read_floor_ms"] >= parts["floor_ms"] > 0  # buckets read at least the KV in use
    t = out["trainer"]
    assert t["plain_tokens_per_s"] > 0 and t["miles_tokens_per_s"] > 0 and t["ratio"] > 0
