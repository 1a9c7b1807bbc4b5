"""A run that trains in the format its engines serve, end to end: engine processes serving nvfp4, Ray,
the FSDP2 trainer with nvfp4 QAT, verified weight sync; the engines' logprobs stay the trainer's."""

import json

import pytest

pytestmark = pytest.mark.e2e


def test_a_qat_run_keeps_engine_and_trainer_on_the_same_policy(tiny_model_dir, tmp_path, ray_cluster):
    from miles.config import load_config
    from miles.config.run import RunConfig
    from miles.orchestration.driver import run_train

    cfg = load_config(RunConfig, None, {
        "model.path": tiny_model_dir, "run.output_dir": str(tmp_path), "run.name": "qat",
        "loop.num_steps": "2", "eval.every_steps": "0", "eval.num_prompts": "8", "eval.max_new_tokens": "4",
        "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "8",
        "rollout.temperature": "1.5", "rollout.reward": "tests.e2e.test_resume:digit_fraction",
        "rollout.engine.quantization": "nvfp4", "trainer.quantization": "nvfp4", "trainer.lr": "1e-3"})
    run_train(cfg)
    records = [json.loads(line) for line in (tmp_path / "qat" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records[1:] if r.get("buffer/groups_trained", 0) > 0]
    assert len(trained) == 2, "both steps should train (the second on weights synced after the first)"
    for r in trained:
        assert r["train/rollout_mismatch_kl"] < 1e-8
        assert r["train/rollout_mismatch_frac"] == 0.0
        assert r["train/rollout_logprob_abs_diff"] < 1e-5
