"""`miles train --resume RUN_DIR`: a sync run whose trainer is SIGKILLed during step 3 (after its
step-2 checkpoint), resumed, gives the same step-3 and step-4 metrics as 4 steps straight. With
fault.restart_trainer the driver does the same in place: a new trainer group, back to the last
checkpoint, and the run completes. Real engine, real Ray, FSDP2 on gloo, checkpoints on disk.
The one_step_off and fully_async schedules: test_resume_overlapped.py (a file of its own, so the two
halves can run side by side)."""

import json

import pytest

pytestmark = pytest.mark.e2e

COMPARED = ("train/loss", "train/grad_norm", "train/nll", "train/clipfrac", "train/loss_tokens",
            "train/rollout_logprob_abs_diff", "rollout/reward_mean", "rollout/response_len_mean")


def digit_fraction(response: str, label) -> float:
    """A reward an untrained model already varies on, so every step has groups to train."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def config(model_dir, out_dir, name, steps, **over):
    from miles.config import load_config
    from miles.run_config import RunConfig

    base = {"model.path": model_dir, "run.output_dir": str(out_dir), "run.name": name,
            "loop.num_steps": str(steps), "loop.save_every": "2", "eval.every_steps": "0", "eval.num_prompts": "8",
            "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "4",
            "eval.max_new_tokens": "4", "trainer.lr": "1e-3", "trainer.lr_schedule": "linear",
            "trainer.lr_warmup_steps": "1", "trainer.lr_decay_steps": "4", "rollout.temperature": "1.5",
            # One sequence per engine forward: logprobs then do not depend on which requests
            # happened to share a batch, so two runs can agree bit for bit.
            "rollout.engine.max_batch_size": "1",
            "rollout.reward": "tests.e2e.test_resume:digit_fraction"}
    base.update(over)
    return load_config(RunConfig, None, base)


def records(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def straight_sync(tiny_model_dir, tmp_path_factory, ray_cluster):
    """4 sync steps without an interruption: what a resumed or restarted run must reproduce."""
    from miles.orchestration.driver import run_train

    out = tmp_path_factory.mktemp("straight")
    run_train(config(tiny_model_dir, out, "straight", 4))
    return out / "straight"


def metric_diffs(straight: dict, again: dict, steps) -> list:
    return [(step, key, straight[step].get(key), again[step].get(key)) for step in steps
            for key in sorted(set(straight[step]) | set(again[step]))
            if key.startswith(("train/", "rollout/")) and not key.endswith("_s") and "per_s" not in key
            and straight[step].get(key) != again[step].get(key)]


def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path, straight_sync):
    from miles.cli import main
    from miles.orchestration.driver import run_train

    from miles.orchestration.trainer_group import TrainerFailure

    with pytest.raises(TrainerFailure, match=r"trainer rank 0 failed in train_step.*miles train --resume"):
        run_train(config(tiny_model_dir, tmp_path, "resumed", 4, **{"fault.kill_trainer_at_step": "3"}))
    resumed = tmp_path / "resumed"
    assert sorted(records(resumed)) == [0, 1, 2]  # step 3 died with its trainer
    ckpts = resumed / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "state_2"
    assert not list(ckpts.glob("*.staging"))  # committed, not half-written
    assert main(["train", "--resume", str(resumed), "--loop.num_steps", "4"]) == 0

    straight, again = records(straight_sync), records(resumed)
    assert sorted(again) == [0, 1, 2, 3, 4]
    assert not metric_diffs(straight, again, (3, 4))
    assert all(key in straight[3] for key in COMPARED)
    assert again[3]["train/lr"] == straight[3]["train/lr"] < straight[2]["train/lr"]  # the schedule resumed
    # Generation after resume ran on the restored weights, version 2 then 3.
    assert [again[s]["rollout/weight_version"] for s in (3, 4)] == [2, 3]
    assert (ckpts / "latest").read_text().strip() == "state_4"

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpts / "step_4")


def test_every_checkpoint_is_complete_when_the_run_returns(straight_sync):
    """Checkpoints are written in the background; the run waits for the last write before it returns."""
    from transformers import AutoModelForCausalLM

    summary = json.loads((straight_sync / "summary.json").read_text())
    ckpts = straight_sync / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "state_4"
    assert not list(ckpts.glob("*.staging")) and not list(ckpts.glob("*.tmp"))  # nothing half-written
    for step in (2, 4):
        state = ckpts / f"state_{step}"
        assert json.loads((state / "meta.json").read_text())["step"] == step
        assert all((state / part).is_file() for part in ("dcp/.metadata", "rank0.pt", "rollout.json"))
        AutoModelForCausalLM.from_pretrained(ckpts / f"step_{step}")
    assert summary["final_checkpoint"] == str(ckpts / "step_4")
    cost = summary["checkpoints"]
    assert cost["saves"] == 3 and cost["mean_write_s"] > 0 and cost["final_wait_s"] is not None


def rollout_state(run_dir, step):
    return json.loads((run_dir / "checkpoints" / f"state_{step}" / "rollout.json").read_text())


def trained_at(run_dir, step) -> dict[int, int]:
    return {int(k): v for k, v in rollout_state(run_dir, step)["ledger"]["trained_at"].items()}


def test_a_killed_trainer_rank_is_restarted_and_the_run_matches_the_uninterrupted_one(
        tiny_model_dir, tmp_path, straight_sync):
    from miles.orchestration.driver import run_train

    # No save between the start and the kill: the restart goes back to the checkpoint written
    # before step 1, and redoes steps 1 and 2 as well.
    summary = run_train(config(tiny_model_dir, tmp_path, "restarted", 4, **{
        "fault.kill_trainer_at_step": "3", "fault.restart_trainer": "true", "loop.save_every": "0"}))
    run_dir = tmp_path / "restarted"
    assert summary["trainer_restarts"] == 1
    assert [f["kind"] for f in summary["faults"]["faults"]] == ["kill_trainer"]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]  # the redone steps are recorded once
    straight, again = records(straight_sync), records(run_dir)
    assert not metric_diffs(straight, again, (1, 2, 3, 4))
    assert trained_at(run_dir, 4) == trained_at(straight_sync, 4)
    assert summary["ledger"]["pending"] == 0


def test_resume_without_a_checkpoint_names_the_fix(tmp_path):
    from miles.cli import main

    with pytest.raises(SystemExit, match="no config.json"):
        main(["train", "--resume", str(tmp_path)])
