"""Bad data is refused before anything starts, naming the file, the row and the field: a missing key,
an empty prompt, a label of the wrong type, a malformed message, a prompt longer than the context."""

from __future__ import annotations

import json

import pytest

from miles.data.config import DataConfig
from miles.data.preflight import check_dataset
from miles.data.rows import DataError
from miles.data.prompts import TaskConfig
from miles.data.source import DatasetSource
from miles.models.loading import load_tokenizer


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GOOD = {"prompt": "1+1=", "label": "2"}
CHAT = {"prompt": [{"role": "user", "content": "1+1="}], "label": "2"}


@pytest.mark.parametrize("good, bad, field, why", [
    (GOOD, {"label": "2"}, "'prompt'", "no field"),
    (GOOD, {"prompt": "  ", "label": "2"}, "'prompt'", "is empty"),
    (CHAT, {"prompt": [], "label": "2"}, "'prompt'", "empty list"),
    (CHAT, {"prompt": [{"role": "user"}], "label": "2"}, "'prompt' message 0", "not a"),
    (CHAT, {"prompt": [{"role": "user", "content": ""}], "label": "2"}, "'prompt'", "only empty messages"),
    (GOOD, {"prompt": {"text": "1+1="}, "label": "2"}, "'prompt'", "is a dict"),
    (GOOD, {"prompt": "1+1="}, "'label'", "no field"),
    (GOOD, {"prompt": "1+1=", "label": [2]}, "'label'", "is a list"),
    (GOOD, {"prompt": "1+1=", "label": True}, "'label'", "is a bool"),
    ({"prompt": "1+1=", "label": [2]}, {"prompt": "1+1=", "label": [3]}, "'label'", "is a list"),
])
def test_bad_row_is_named_by_file_row_and_field(tmp_path, good, bad, field, why):
    path = _jsonl(tmp_path / "data.jsonl", [good, good, bad, good])
    with pytest.raises(DataError) as e:
        DatasetSource(DataConfig(path=path, eval_fraction=0), "train", 0)
    msg = str(e.value)
    assert f"{path} row {0 if good['label'] == [2] else 2}:" in msg and field in msg and why in msg, msg


def test_bad_parquet_row_is_named(tmp_path):
    import datasets

    path = str(tmp_path / "d.parquet")
    datasets.Dataset.from_list([GOOD, {"prompt": "", "label": "1"}]).to_parquet(path)
    with pytest.raises(DataError, match=r"d.parquet row 1: field 'prompt' \(the prompt\) is empty"):
        DatasetSource(DataConfig(path=path, eval_fraction=0), "train", 0)


def test_missing_file_and_unknown_split_are_named(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        DatasetSource(DataConfig(path=str(tmp_path / "nope.jsonl")), "train", 0)
    path = _jsonl(tmp_path / "d.csv", [GOOD])
    with pytest.raises(DataError, match=r"bad.jsonl row 1: not valid JSON"):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "label": "1"}\n{"prompt": \n')
        DatasetSource(DataConfig(path=str(tmp_path / "bad.jsonl")), "train", 0)
    with pytest.raises(DataError, match="d.csv: give .jsonl, .json or .parquet files"):
        DatasetSource(DataConfig(path=path), "train", 0)


def test_prompt_longer_than_the_engine_context(tmp_path, tiny_model_dir):
    path = _jsonl(tmp_path / "data.jsonl", [GOOD, {"prompt": "word " * 60, "label": "x"}])
    task = TaskConfig(name="dataset", data=DataConfig(path=path, eval_fraction=0))
    tokenizer = load_tokenizer(tiny_model_dir)
    assert check_dataset(task, tokenizer, tiny_model_dir, None)["train"] == 2  # fits the model's max_position_embeddings
    with pytest.raises(DataError) as e:
        check_dataset(task, tokenizer, tiny_model_dir, 64)  # rollout.engine.context_length
    assert f"{path} row 1:" in str(e.value) and "'prompt'" in str(e.value) and "context is 64" in str(e.value)


def test_run_refuses_bad_data_before_anything_starts(tmp_path, tiny_model_dir):
    from miles.orchestration.driver import run_train
    from tests.helpers.runs import small_config

    path = _jsonl(tmp_path / "data.jsonl", [GOOD, {"prompt": "", "label": "1"}])
    cfg = small_config(tiny_model_dir, tmp_path / "out", **{"rollout.task.name": "dataset",
                                                            "rollout.task.data.path": path})
    with pytest.raises(SystemExit, match=r"data.jsonl row 1: field 'prompt' \(the prompt\) is empty"):
        run_train(cfg)
    assert not (tmp_path / "out").exists()  # no run directory, no Ray, no engine
