"""The vision example (examples/vision/) as a user runs it, cut short: its data drawn by make_data.py,
its SFT config for 2 steps and its GRPO config for 2 steps on tiny-qwen-vl over a real local Ray
cluster, with its reward file's metrics; then `miles eval` on the result reports pass@k."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import load_config
from miles.run_config import RunConfig

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "examples" / "vision"


@pytest.mark.slow
def test_vision_example_trains_and_evaluates_with_pass_at_k(tiny_vl_model_dir, tmp_path, ray_cluster, monkeypatch):
    from miles.orchestration.driver import run_sft, run_train

    monkeypatch.chdir(ROOT)  # run.sh runs from the repository root; the configs' paths are relative to it
    subprocess.run([sys.executable, str(HERE / "make_data.py"), str(tmp_path / "data")], check=True)
    data = {"rollout.task.data.path": str(tmp_path / "data" / "train.parquet"),
            "rollout.task.data.eval_path": str(tmp_path / "data" / "eval.parquet")}
    sft_cfg = load_config(RunConfig, str(HERE / "sft.toml"), {
        "model.path": tiny_vl_model_dir, "sft.out": str(tmp_path / "sft-model"), "sft.steps": "2",
        "sft.batch_size": "8", "sft.target_accuracy": "0", "run.output_dir": str(tmp_path), **data})
    assert sft_cfg.trainer.train_vision_tower
    run_sft(sft_cfg)

    over = {"model.path": str(tmp_path / "sft-model"), "run.output_dir": str(tmp_path), "run.name": "grpo",
            "loop.num_steps": "2", "eval.every_steps": "0", "eval.num_prompts": "8",
            "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "sync.bucket_size_mb": "1", **data}
    cfg = load_config(RunConfig, str(HERE / "grpo.toml"), over)
    assert cfg.rollout.reward == "examples/vision/reward.py:count_dots"
    summary = run_train(cfg)
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/number" in r for r in records if r["step"] >= 1)

    out = tmp_path / "eval.json"
    subprocess.run([sys.executable, "-m", "miles.cli", "eval", str(HERE / "grpo.toml"), "--model.path",
                    summary["final_checkpoint"], "--eval.num_prompts", "8",
                    "--out", str(out), *[a for k, v in data.items() for a in (f"--{k}", v)]], check=True)
    figures = json.loads(out.read_text())
    assert {"eval/accuracy", "eval/sampled/pass@1", "eval/sampled/pass@4"} <= set(figures)
