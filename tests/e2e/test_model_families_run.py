"""Two GRPO steps of `miles train` on each model family's tiny preset the built-in engine serves:
engine process, Ray, FSDP2 trainer, weight sync, with routing replay on. In float32 throughout, the
replayed trainer agrees with the engine: no routing mismatch and a rollout-vs-trainer logprob gap
at rounding, on every family's router (DeepSeek-V3's and GLM-4.5's sigmoid + bias, group-limited,
scaled; GLM-5's, between MLA layers with DSA indexers; MiniMax-M2's sigmoid + bias; GPT-OSS's
softmax over the chosen logits, with its sliding-window layers and sinks; Qwen3-Next's and Qwen3.5's
softmax with a shared expert and Nemotron-H's sigmoid + bias, between their gated delta-net and
Mamba-2 layers): the mean gap is under 1e-5 on every family, Nemotron-H's included since the
engine's Mamba-2 decode step clamps the time step as the trainer's chunked form does
(engine/mamba_step.py)."""

import json

import pytest

from tests.helpers.runs import small_config

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-glm4-moe", "tiny-glm5", "tiny-minimax-m2", "tiny-gpt-oss",
                                    "tiny-qwen3-next", "tiny-qwen3-5-moe", "tiny-nemotron-h"])
def test_two_grpo_steps_with_routing_replay(preset, preset_dir, tmp_path, ray_cluster):
    from miles.orchestration.driver import run_train

    summary = run_train(small_config(preset_dir(preset), tmp_path, **{
        "loop.num_steps": "2", "eval.every_steps": "0", "rollout.prompts_per_step": "2",
        "rollout.max_new_tokens": "8", "rollout.temperature": "1.5", "rollout.reward": "text_parity",
        "rollout.return_routed_experts": "true", "trainer.routing_replay": "true"}))
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records[1:] if r.get("buffer/groups_trained", 0) > 0]
    assert trained, "no step had a group to train"
    for r in trained:
        assert r["train/r3_mismatch_rate"] == 0.0
        assert r["train/rollout_logprob_abs_diff"] < 1e-5
    assert [r["rollout/weight_version"] for r in records[1:]] == [0, 1]  # step 2 ran on step 1's weights
