"""A short RL run on the user's own JSONL dataset (chat-message prompts through the preset's chat
template, a separate eval file) over a real local Ray cluster; the checkpoint carries the data cursor."""

import json

import pytest

from tests.helpers.runs import small_config

pytestmark = pytest.mark.e2e


def test_two_steps_on_a_jsonl_dataset(tiny_model_dir, tmp_path, ray_cluster):
    from miles.orchestration.driver import run_train

    def rows(pairs):
        return "".join(json.dumps({"input": [{"role": "user", "content": f"{a}+{b}="}], "label": str(a + b),
                                   "metadata": {"a": a}}) + "\n" for a, b in pairs)

    (tmp_path / "train.jsonl").write_text(rows([(a, a + 1) for a in range(6)]))
    (tmp_path / "eval.jsonl").write_text(rows([(a, 2 * a) for a in range(10, 14)]))
    summary = run_train(small_config(tiny_model_dir, tmp_path, **{
        "loop.num_steps": "2", "eval.every_steps": "0", "rollout.task.name": "dataset",
        "rollout.task.system_prompt": "Answer with the number.",
        "rollout.task.data.layout": "slime", "rollout.task.data.path": str(tmp_path / "train.jsonl"),
        "rollout.task.data.eval_path": str(tmp_path / "eval.jsonl")}))
    assert summary["steps"] == 2 and 0.0 <= summary["eval_accuracy_after"] <= 1.0
    run_dir = tmp_path / "e2e"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and all("rollout/reward_mean" in r for r in records[1:])
    state = json.loads((run_dir / "checkpoints" / "state_2" / "rollout.json").read_text())
    # At least 2 steps x 4 prompts from 6 rows: the cursor is in the second epoch, at the ledger's count.
    drawn = summary["ledger"]["drawn"]
    cursor = state["source"]["task"]
    assert drawn >= 8 and state["source"]["position"] == drawn
    assert (cursor["num_rows"], cursor["seed"], cursor["shuffle"]) == (6, 0, True)
    assert cursor["epoch"] * 6 + cursor["position"] == drawn and cursor["epoch"] >= 1
