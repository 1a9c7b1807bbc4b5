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
    # An eval set sampled twice per prompt, beside the greedy eval/accuracy.
    (tmp_path / "run.toml").write_text('[[eval.sets]]\nname = "sampled"\nn = 2\nk = [1, 2]\n'
                                       'metrics = ["pass", "avg"]\nnum_prompts = 3\nmax_new_tokens = 4\n')
    summary = run_train(small_config(tiny_model_dir, tmp_path, config_path=tmp_path / "run.toml", **{
        "loop.num_steps": "2", "eval.every_steps": "2", "rollout.task.name": "dataset",
        "rollout.task.system_prompt": "Answer with the number.",
        "rollout.task.data.layout": "slime", "rollout.task.data.path": str(tmp_path / "train.jsonl"),
        "rollout.task.data.eval_path": str(tmp_path / "eval.jsonl")}))
    assert summary["steps"] == 2 and 0.0 <= summary["eval_accuracy_after"] <= 1.0
    run_dir = tmp_path / "e2e"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and all("rollout/reward_mean" in r for r in records[1:])
    # summary.json carries every eval figure of the evaluation before RL and of the last one.
    written = json.loads((run_dir / "summary.json").read_text())
    for when, record in (("eval_before", records[0]), ("eval_after", records[2])):
        figures = written[when]
        assert {"eval/accuracy", "eval/sampled/pass@2", "eval/sampled/avg@1"} <= set(figures)
        assert all(figures[k] == record[k] for k in figures)
    state = json.loads((run_dir / "checkpoints" / "state_2" / "rollout.json").read_text())
    # At least 2 steps x 4 prompts from 6 rows: the cursor is in the second epoch, at the ledger's count.
    drawn = summary["ledger"]["drawn"]
    cursor = state["source"]["task"]
    assert drawn >= 8 and state["source"]["position"] == drawn
    assert (cursor["num_rows"], cursor["seed"], cursor["shuffle"]) == (6, 0, True)
    assert cursor["epoch"] * 6 + cursor["position"] == drawn and cursor["epoch"] >= 1


def _verl_parquet(tmp_path, pairs):
    import datasets

    rows = [{"data_source": "arith", "ability": "math", "extra_info": {"index": i},
             "prompt": [{"role": "user", "content": f"{a}+{b}="}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}} for i, (a, b) in enumerate(pairs)]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return {"rollout.task.data.layout": "verl", "rollout.task.data.path": str(path)}


@pytest.mark.slow
def test_a_verl_parquet_dataset_trains(tiny_model_dir, tmp_path, ray_cluster):
    """A second layout end to end (Parquet, nested chat prompts, the label under reward_model): its rows
    reach the engines and the trainer. Every layout's rows are checked in tests/unit/data/test_layouts.py;
    past loading, the run does not know which layout they came from."""
    from miles.orchestration.driver import run_train

    keys = _verl_parquet(tmp_path, [(a, a + 1) for a in range(10)])
    summary = run_train(small_config(tiny_model_dir, tmp_path, **{
        "loop.num_steps": "2", "eval.every_steps": "0", "rollout.task.name": "dataset",
        # A tiny untrained model scores 0 everywhere: keep its zero-advantage groups so steps train.
        "rollout.task.data.eval_fraction": "0.2", "buffer.filter": "none", **keys}))
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["step"] > 0]
    assert len(trained) == 2 and all(r["buffer/samples_trained"] > 0 and r["train/loss_tokens"] > 0 for r in trained)
    assert summary["ledger"]["drawn"] >= 8
