"""`miles train --resume RUN_DIR` and fault.restart_trainer under the overlapped schedules: a run whose
trainer is SIGKILLed during step 3 (after its step-2 checkpoint) trains every prompt exactly once
(one_step_off: at the same step as 4 steps straight; fully_async: one step's worth per step, the
groups in flight at the checkpoint regenerated), resumed by a new `miles train --resume` or restarted
in place. Real engine, real Ray, FSDP2 on gloo, checkpoints on disk. The sync schedule: test_resume.py."""

import json

import pytest

from tests.e2e.test_resume import config, records, rollout_state, trained_at

pytestmark = pytest.mark.e2e


def kill_during_step_3_then_resume(tiny_model_dir, tmp_path, name, **over):
    from miles.cli import main
    from miles.orchestration.driver import run_train
    from miles.orchestration.trainer_group import TrainerFailure

    with pytest.raises(TrainerFailure):
        run_train(config(tiny_model_dir, tmp_path, name, 4, **{"fault.kill_trainer_at_step": "3", **over}))
    run_dir = tmp_path / name
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "state_2"
    assert main(["train", "--resume", str(run_dir), "--loop.num_steps", "4"]) == 0
    assert sorted(records(run_dir)) == [0, 1, 2, 3, 4]
    return run_dir


@pytest.mark.slow
def test_one_step_off_resumed_trains_each_prompt_at_the_step_an_uninterrupted_run_does(
        tiny_model_dir, tmp_path, ray_cluster):
    from miles.orchestration.driver import run_train

    # No filter: every group trains, so which prompt trains at which step is the schedule's alone.
    over = {"loop.schedule": "one_step_off", "buffer.filter": "none"}
    run_train(config(tiny_model_dir, tmp_path, "straight", 4, **over))
    resumed = kill_during_step_3_then_resume(tiny_model_dir, tmp_path, "resumed", **over)

    # The step-2 checkpoint caught step 3's batch: some groups arrived, the rest still generating.
    caught = rollout_state(resumed, 2)
    assert len(caught["ready"]) + len(caught["in_flight"]) == 4
    assert json.loads((resumed / "checkpoints" / "state_2" / "meta.json").read_text())["batch_in_flight"]
    straight = trained_at(tmp_path / "straight", 4)
    assert sorted(straight.values()) == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert trained_at(resumed, 4) == straight
    ledger = json.loads((resumed / "summary.json").read_text())["ledger"]
    assert ledger["drawn"] == ledger["trained"] == 16 and ledger["pending"] == 0


def test_fully_async_resumed_regenerates_what_was_in_flight_and_trains_nothing_twice(
        tiny_model_dir, tmp_path, ray_cluster):
    over = {"loop.schedule": "fully_async", "buffer.filter": "none", "buffer.max_inflight_groups": "4",
            "buffer.capacity": "4"}
    resumed = kill_during_step_3_then_resume(tiny_model_dir, tmp_path, "resumed", **over)

    caught = rollout_state(resumed, 2)
    in_flight = {p["index"] for p in caught["in_flight"]}
    assert in_flight, "the producer always has groups in flight; the checkpoint must hold them"
    before, after = trained_at(resumed, 2), trained_at(resumed, 4)
    # What the checkpoint had trained stays trained at its step; the resumed run trains one step's
    # worth per step, as an uninterrupted run does, and never a prompt trained before.
    assert {i: after[i] for i in before} == before
    assert sorted(after.values()) == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    states = {int(k): v for k, v in rollout_state(resumed, 4)["ledger"]["states"].items()}
    assert sorted(states) == list(range(len(states)))  # no prompt skipped in the source's order
    # Each prompt in flight at the checkpoint was generated again: trained, discarded, or still pending.
    assert all(states[i] in ("trained", "discarded", "retry_pending", "buffered") for i in in_flight)
    assert any(states[i] == "trained" and after[i] > 2 for i in in_flight)
    ledger = json.loads((resumed / "summary.json").read_text())["ledger"]
    assert ledger["trained"] == 16 and ledger["drawn"] == ledger["trained"] + ledger["discarded"] + ledger["pending"]



@pytest.mark.parametrize("schedule", [pytest.param(s, marks=pytest.mark.slow) for s in ("one_step_off", "fully_async")])
def test_overlapped_runs_restart_a_killed_trainer_and_train_every_prompt_once(
        tiny_model_dir, tmp_path, ray_cluster, schedule):
    from miles.orchestration.driver import run_train

    summary = run_train(config(tiny_model_dir, tmp_path, "restarted", 4, **{
        "loop.schedule": schedule, "buffer.filter": "none", "buffer.max_inflight_groups": "4",
        "buffer.capacity": "4", "fault.kill_trainer_at_step": "3", "fault.restart_trainer": "true"}))
    run_dir = tmp_path / "restarted"
    assert summary["trainer_restarts"] == 1
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]
    before, after = trained_at(run_dir, 2), trained_at(run_dir, 4)
    assert {i: after[i] for i in before} == before
    assert sorted(after.values()) == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    states = {int(k): v for k, v in rollout_state(run_dir, 4)["ledger"]["states"].items()}
    assert sorted(states) == list(range(len(states)))
    ledger = summary["ledger"]
    assert ledger["drawn"] == ledger["trained"] + ledger["discarded"] + ledger["pending"]
