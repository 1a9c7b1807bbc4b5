"""A run that trains in the format its engines serve, end to end: engine processes serving nvfp4, Ray,
the FSDP2 trainer with nvfp4 QAT, verified weight sync; the engines' logprobs stay the trainer's."""

import json

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_a_qat_run_keeps_engine_and_trainer_on_the_same_policy(tiny_model_dir, tmp_path, ray_cluster):
    from miles.config import load_config
    from miles.run_config import RunConfig
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


@pytest.mark.slow
def test_bench_lowprec_rl_cell_trains_in_the_format_with_the_embeddings_and_reports_its_gap(
        tiny_model_dir, tmp_path, ray_cluster, capsys):
    # One cell of `miles bench lowprec --rl` (the baseline's accuracy given): a GRPO step of the arithmetic
    # job with the engine and the trainer in nvfp4, embedding and LM head included, over the run's real
    # weight sync; the engine stays on the trainer's policy, and the line reports the cell against bf16.
    from benchmarks import lowprec

    assert lowprec.main(["--rl", "--sft-model", tiny_model_dir, "--rl-steps", "1", "--formats", "nvfp4",
                         "--recipes", "qat_tis_embeddings", "--eval-prompts", "4", "--prompts-per-step", "2",
                         "--bf16-accuracy", "0.5", "--out", str(tmp_path),
                         # An untrained model never gets an exact answer: reward digits instead (as above).
                         "--override", "rollout.reward=tests.e2e.test_resume:digit_fraction",
                         "--override", "rollout.temperature=1.5", "--override", "rollout.n_samples_per_prompt=4",
                         "--override", "rollout.max_new_tokens=8", "--override", "eval.max_new_tokens=4"]) == 0
    cell, summary = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines()[-2:])
    assert (cell["format"], cell["recipe"], cell["steps"]) == ("nvfp4", "qat_tis_embeddings", 1)
    assert cell["gap_points"] == 100 * (0.5 - cell["eval_accuracy"])
    assert cell["wire_bytes_ratio_vs_bf16"] <= 0.3
    config = json.loads((tmp_path / "runs" / "nvfp4-qat_tis_embeddings" / "config.json").read_text())
    assert config["rollout"]["engine"]["quantize_embeddings"] and config["trainer"]["quantize_embeddings"]
    assert cell["mismatch_kl"] < 1e-8 and cell["mismatch_frac"] == 0.0
    assert summary["formats"]["nvfp4"]["qat_tis_embeddings"] == cell["eval_accuracy"]
    assert summary["max_gap_points_full_recipe"] is None  # no plain qat_tis cell ran
