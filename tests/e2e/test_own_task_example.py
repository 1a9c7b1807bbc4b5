"""The bring-your-own-task example (examples/own_task/) as a user runs it, cut short: its SFT config
for 2 steps and its GRPO config for 2 steps on the tiny model over a real local Ray cluster. The run
trains on the example's dataset and logs the extra metrics of the example's reward file."""

import json
import os
from pathlib import Path

import pytest

from miles.config import load_config
from miles.run_config import RunConfig

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "examples" / "own_task"


@pytest.mark.slow
def test_own_task_example_trains_on_its_dataset_with_its_reward(tiny_model_dir, tmp_path, ray_cluster, monkeypatch):
    from miles.orchestration.driver import run_sft, run_train

    monkeypatch.chdir(ROOT)  # run.sh runs from the repository root; the configs' paths are relative to it
    sft_cfg = load_config(RunConfig, str(HERE / "sft.toml"), {
        "model.path": tiny_model_dir, "sft.out": str(tmp_path / "sft-model"), "sft.steps": "2",
        "sft.batch_size": "8", "run.output_dir": str(tmp_path)})
    assert sft_cfg.rollout.task.name == "dataset"
    run_sft(sft_cfg)
    assert (tmp_path / "sft-model" / "config.json").exists()

    cfg = load_config(RunConfig, str(HERE / "grpo.toml"), {
        "model.path": str(tmp_path / "sft-model"), "run.output_dir": str(tmp_path), "run.name": "grpo",
        "loop.num_steps": "2", "eval.every_steps": "0", "eval.num_prompts": "8",
        "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "sync.bucket_size_mb": "1"})
    assert cfg.rollout.reward == "examples/own_task/reward.py:digit_sum"
    summary = run_train(cfg)
    assert summary["steps"] == 2 and 0.0 <= summary["eval_accuracy_after"] <= 1.0
    run_dir = tmp_path / "grpo"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("reward/numeric" in r and "reward/off_by" in r and "rollout/reward_mean" in r for r in steps)
    # The cursor in the checkpoint is over the example's 750 training rows.
    state = json.loads((run_dir / "checkpoints" / "state_2" / "rollout.json").read_text())
    assert state["source"]["task"]["num_rows"] == 750
    assert os.path.getsize(HERE / "train.jsonl") + os.path.getsize(HERE / "eval.jsonl") < 1_000_000
