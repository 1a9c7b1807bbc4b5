"""`miles bench lowprec --eval-model`: the same checkpoint's greedy accuracy served bfloat16 and in each
format, graded as exact answers."""

from __future__ import annotations

import json

import httpx

from benchmarks import lowprec
from miles.engine.config import EngineConfig
from miles.engine.server import start_server_thread
from miles.data.tasks.contract import Problem

PROMPTS = ["07+38=", "91-45=", "33+33="]


def _greedy(model_dir: str, prompt: str, n: int) -> str:
    server = start_server_thread(EngineConfig(model_path=model_dir, dtype="float32", quantization="fp8", seed=0))
    try:
        r = httpx.post(f"{server.url}/generate", timeout=120, json={"text": prompt, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": n}})
        return r.json()["text"]
    finally:
        server.stop()


def test_eval_accuracy_is_the_share_of_greedy_completions_equal_to_the_answer(base_model_dir):
    # Answers set to what the fp8-served model itself completes greedily: all right; one altered: 2 of 3.
    problems = [Problem(prompt=p, answer=_greedy(base_model_dir, p, 5).strip()) for p in PROMPTS]
    assert all(p.answer for p in problems)
    assert lowprec.eval_accuracy(base_model_dir, "float32", "fp8", problems, max_new_tokens=5) == 1.0
    problems[1] = Problem(prompt=problems[1].prompt, answer=problems[1].answer + "0")
    assert lowprec.eval_accuracy(base_model_dir, "float32", "fp8", problems, max_new_tokens=5) == 2 / 3


def test_the_eval_line_has_bf16_and_every_format(base_model_dir, capsys):
    assert lowprec.main(["--formats", "fp8,int4", "--eval-model", base_model_dir, "--eval-problems", "4",
                         "--eval-only"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["eval"] == "greedy_accuracy" and line["problems"] == 4
    assert set(line["formats"]) == {"fp8", "int4"}
    accs = [line["eval_accuracy_bf16"], *line["formats"].values()]
    assert all(a in (0.0, 0.25, 0.5, 0.75, 1.0) for a in accs)
    assert line["max_gap_points"] == max(100 * (line["eval_accuracy_bf16"] - a) for a in line["formats"].values())
    assert "formats_with_embeddings" not in line  # only asked for with --quantize-embeddings


def test_the_eval_line_with_quantize_embeddings_serves_each_format_both_ways(base_model_dir, capsys):
    assert lowprec.main(["--formats", "int4", "--eval-model", base_model_dir, "--eval-problems", "2",
                         "--eval-only", "--quantize-embeddings"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(line["formats_with_embeddings"]) == {"int4"} and line["formats_with_embeddings"]["int4"] in (0, 0.5, 1)
    ratios, with_emb = line["wire_bytes_ratio_vs_bf16"]["int4"], line["wire_bytes_ratio_vs_bf16_with_embeddings"]["int4"]
    assert with_emb <= 0.3 < ratios


def test_the_wire_bytes_ratio_is_what_a_push_to_an_engine_serving_the_format_moves(base_model_dir):
    # The Linear weights as the format's bytes and scales; embeddings (tied with the LM head) and norms
    # in bfloat16 are a large share of so small a model.
    assert 0.5 < lowprec.wire_bytes_ratio(base_model_dir, "fp8") < 0.55
    assert 0.3 < lowprec.wire_bytes_ratio(base_model_dir, "int4") < lowprec.wire_bytes_ratio(base_model_dir, "nvfp4") < 0.33
    # With the tied embedding and LM head in the format too (quantize_embeddings), both 4-bit formats
    # move at most 0.3x; only the norms are left in bfloat16.
    assert 0.26 < lowprec.wire_bytes_ratio(base_model_dir, "int4", embeddings=True) <= 0.3
    assert 0.27 < lowprec.wire_bytes_ratio(base_model_dir, "nvfp4", embeddings=True) <= 0.3
