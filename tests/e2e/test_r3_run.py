"""An MoE training run with routing replay end to end: bf16 engine process, Ray, FSDP2 trainer in
fp32, weight sync; routed experts travel from the engine through the buffer to the trainer, whose
routing-mismatch metric reaches the run's metrics."""

import json

import pytest

pytestmark = pytest.mark.e2e


def test_moe_grpo_run_with_routing_replay_reports_mismatch(tiny_moe_model_dir, tmp_path, ray_cluster):
    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.orchestration.driver import run_train

    cfg = load_config(RunConfig, None, {
        "model.path": tiny_moe_model_dir, "run.output_dir": str(tmp_path), "run.name": "r3",
        "loop.num_steps": "2", "eval.every_steps": "0", "eval.num_prompts": "8", "eval.max_new_tokens": "4",
        "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "8",
        "rollout.temperature": "1.5", "rollout.reward": "tests.e2e.test_resume:digit_fraction",
        "rollout.engine.dtype": "bfloat16", "sync.dtype": "bfloat16",
        "rollout.return_routed_experts": "true", "trainer.routing_replay": "true"})
    run_train(cfg)
    records = [json.loads(line) for line in (tmp_path / "r3" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records[1:] if r.get("buffer/groups_trained", 0) > 0]
    assert trained, "no step had a group to train"
    for r in trained:
        assert 0.0 <= r["train/r3_mismatch_rate"] < 0.2
        assert r["train/rollout_logprob_abs_diff"] < 0.1
