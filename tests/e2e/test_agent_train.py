"""Multi-turn agent rollouts inside a real training run: Ray, engine process, FSDP2 trainer, weight sync."""

import json

import pytest

pytestmark = pytest.mark.e2e


def test_grpo_on_calculator_episodes_trains_on_model_tokens_only(tiny_model_dir, tmp_path, ray_cluster):
    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.orchestration.driver import run_train

    cfg = load_config(RunConfig, "examples/tool_calc/grpo.toml", {
        "model.path": tiny_model_dir, "run.output_dir": str(tmp_path), "run.name": "agent",
        "loop.num_steps": "2", "eval.every_steps": "2", "eval.num_prompts": "8",
        "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "6",
        "rollout.agent.max_response_tokens": "40", "eval.max_new_tokens": "6", "sync.bucket_size_mb": "1"})
    assert cfg.rollout.generate_fn == "agent" and cfg.rollout.agent.environment == "tool_calc"
    summary = run_train(cfg)
    records = [json.loads(line) for line in (tmp_path / "agent" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    assert records[-1]["rollout/weight_version"] == 1  # step 2 generated under the weights pushed after step 1
    assert summary["eval_accuracy_after"] == records[-1]["eval/accuracy"]


def test_a_bad_environment_is_refused_when_the_run_is_configured(tiny_model_dir, tmp_path):
    from miles.config import ConfigError, load_config
    from miles.run_config import RunConfig

    with pytest.raises(ConfigError, match="rollout.agent.environment: unknown environment 'calculator'"):
        load_config(RunConfig, "examples/tool_calc/grpo.toml", {
            "model.path": tiny_model_dir, "rollout.agent.environment": "calculator"})
    with pytest.raises(ConfigError, match="rollout.generate_fn: unknown generate function 'multi'"):
        load_config(RunConfig, "examples/tool_calc/grpo.toml", {"model.path": tiny_model_dir,
                                                                "rollout.generate_fn": "multi"})
