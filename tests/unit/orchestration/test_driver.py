"""Going back to a checkpoint cuts metrics.jsonl back to it: no step recorded twice, no torn line kept,
and a sink that has the file open keeps appending where the cut left it."""

import json

import pytest

from miles.metrics.sink import JsonlSink, read_metrics
from miles.orchestration.driver import rewind_run_dir, run_admin_token
from miles.trainer.checkpoint import commit


def test_rewind_keeps_the_records_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    staging = tmp_path / "checkpoints" / "state_2.staging"
    staging.mkdir(parents=True)
    commit(staging, tmp_path / "checkpoints" / "state_2", {"step": 2})
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in range(4):
        sink.write(step, {"train/loss": float(step)})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "train/lo')  # the process died mid-write

    assert rewind_run_dir(tmp_path) == 2
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    sink.write(3, {"train/loss": 30.0})  # the run goes on from the checkpoint, through the same sink
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]
    assert json.loads(lines[-1])["train/loss"] == 30.0


def test_rewind_without_a_checkpoint_names_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="no resumable checkpoint"):
        rewind_run_dir(tmp_path)


def test_a_run_always_locks_the_engines_and_router_it_starts_with_a_fresh_token(monkeypatch):
    monkeypatch.delenv("MILES_ENGINE_ADMIN_TOKEN", raising=False)
    tokens = {run_admin_token(external=False) for _ in range(3)}
    assert len(tokens) == 3 and all(len(t) == 32 and int(t, 16) >= 0 for t in tokens)
    # Engines the run did not start keep their operator's token, read from the environment only.
    assert run_admin_token(external=True) is None
    monkeypatch.setenv("MILES_ENGINE_ADMIN_TOKEN", "theirs")
    assert run_admin_token(external=True) == "theirs"
    assert run_admin_token(external=False) != "theirs"


def test_a_resumed_run_takes_the_token_of_the_router_its_killed_driver_left(tmp_path):
    """So that it can adopt that router, and the router speaks for the new engines with it."""
    from miles.orchestration.router_supervisor import RECORD, RouterRecord

    assert len(run_admin_token(external=False, run_dir=tmp_path)) == 32  # no router left: a fresh one
    RouterRecord("http://127.0.0.2:1", 1, "here", "left-behind", "", 0.0).save(tmp_path / RECORD)
    assert run_admin_token(external=False, run_dir=tmp_path) == "left-behind"
    assert run_admin_token(external=False) != "left-behind"  # a new run (no run_dir to resume)
