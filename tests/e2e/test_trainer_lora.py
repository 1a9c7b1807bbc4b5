"""LoRA end to end, disaggregated: only adapters train, the engines receive merged weights under
the base model's names after every step, and the exported checkpoint is a plain HF model."""

import json

import pytest

pytestmark = pytest.mark.e2e


def test_lora_run_syncs_merged_weights_to_the_engine(tiny_model_dir, tmp_path, ray_cluster):
    from miles.config import load_config
    from miles.config.run import RunConfig
    from miles.orchestration.driver import run_train

    cfg = load_config(RunConfig, None, {
        "model.path": tiny_model_dir, "run.output_dir": str(tmp_path), "run.name": "lora", "loop.num_steps": "2",
        "eval.every_steps": "0", "eval.num_prompts": "8", "eval.max_new_tokens": "4",
        "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "4",
        "rollout.temperature": "1.5", "rollout.reward": "tests.e2e.test_resume:digit_fraction",
        "trainer.lr": "1e-2", "trainer.lora.rank": "4", "trainer.lora.sync": "merged"})
    summary = run_train(cfg)
    records = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert all(r["sync/lora_merged"] == 1.0 for r in steps)
    assert all("train/loss" in r for r in steps)
    assert [r["rollout/weight_version"] for r in steps] == [0, 1]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(summary["final_checkpoint"])
    assert not any("lora" in n for n, _ in model.named_parameters())
