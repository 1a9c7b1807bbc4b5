"""Short GRPO runs on the Megatron backend end to end over a real local Ray cluster: at tensor parallel 2
the engine fed each step's weights gathered from the TP shards and the final checkpoint an HF export
transformers loads; tiny-qwen3-moe at expert parallel 2 with routing replay, mismatch 0; and a killed
trainer group restarted from its checkpoint, matching the run that was never killed."""

import json

import pytest

from tests.helpers.runs import small_config

pytestmark = pytest.mark.e2e


def test_two_grpo_steps_on_megatron_tp2_reach_the_engine(tiny_model_dir, tmp_path, ray_cluster):
    from transformers import AutoModelForCausalLM

    from miles.orchestration.driver import run_train

    summary = run_train(small_config(tiny_model_dir, tmp_path, **{
        "loop.num_steps": "2", "eval.every_steps": "0", "buffer.filter": "none", "trainer.backend": "megatron",
        "trainer.num_ranks": "2", "trainer.tensor_parallel_size": "2"}))
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 2
    # Every sample of step k was generated under weight version k-1: the push after each step landed,
    # verified against the trainer's gathered tensors (noise fill first, checksums after).
    assert [r["rollout/weight_version"] for r in steps] == [0, 1]
    assert all(r["train/loss_tokens"] > 0 for r in steps)  # every group trained (buffer.filter = "none")
    AutoModelForCausalLM.from_pretrained(summary["final_checkpoint"])  # the export loads


def test_moe_grpo_on_megatron_ep2_replays_the_engines_routing_with_no_mismatch(tiny_moe_model_dir, tmp_path,
                                                                              ray_cluster):
    """tiny-qwen3-moe with experts split over two Megatron ranks and R3: a float32 engine records each
    token's experts and Megatron's routers, choosing before they replay, agree on every token, as the
    float32 trainer does on FSDP (tests/unit/trainer/test_r3_families.py)."""
    from miles.orchestration.driver import run_train

    run_train(small_config(tiny_moe_model_dir, tmp_path, **{
        "loop.num_steps": "2", "eval.every_steps": "0", "buffer.filter": "none", "rollout.max_new_tokens": "8",
        "rollout.engine.dtype": "float32", "rollout.return_routed_experts": "true", "trainer.routing_replay": "true",
        "trainer.backend": "megatron", "trainer.num_ranks": "2", "trainer.expert_parallel_size": "2"}))
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert [r["rollout/weight_version"] for r in steps] == [0, 1]
    for r in steps:
        assert r["train/r3_mismatch_rate"] == 0.0
        assert r["train/rollout_logprob_abs_diff"] <= 1e-5


def test_a_killed_megatron_trainer_is_restarted_and_the_run_matches_the_uninterrupted_one(tiny_model_dir, tmp_path,
                                                                                         ray_cluster):
    """As FSDP's (tests/e2e/test_resume.py): the trainer group at TP 2 is killed during step 2, a new one
    loads the step-1 checkpoint (each rank its own shards) and redoes step 2, which then gives the
    metrics of the run that was never killed."""
    from miles.orchestration.driver import run_train
    from tests.e2e.test_resume import config, metric_diffs, records

    megatron = {"trainer.backend": "megatron", "trainer.num_ranks": "2", "trainer.tensor_parallel_size": "2",
                "loop.save_every": "1"}
    run_train(config(tiny_model_dir, tmp_path, "straight", 2, **megatron))
    summary = run_train(config(tiny_model_dir, tmp_path, "restarted", 2, **megatron, **{
        "fault.kill_trainer_at_step": "2", "fault.restart_trainer": "true"}))
    assert summary["trainer_restarts"] == 1
    straight, again = records(tmp_path / "straight"), records(tmp_path / "restarted")
    assert sorted(again) == [0, 1, 2]
    assert "train/loss" in again[2] and not metric_diffs(straight, again, (1, 2))
