"""Each layout users bring (verl parquet with messages, slime JSONL, TRL plain and conversational, a
`datasets` save_to_disk directory, a glob of files) loads into Prompts with the right text, messages,
label and metadata; splits come from files, named splits or a held-out share."""

from __future__ import annotations

import json

import datasets

from miles.data.config import DataConfig
from miles.data.prompts import PromptSource, TaskConfig


def _source(split="train", seed=0, **data) -> PromptSource:
    data.setdefault("eval_fraction", 0.0)
    data.setdefault("shuffle", False)
    return PromptSource(TaskConfig(name="dataset", data=DataConfig(**data)), split, seed)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_verl_parquet_rows_with_chat_messages(tmp_path):
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "system", "content": "Think step by step."},
                        {"role": "user", "content": f"What is {i} + {i}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(3)]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    prompts = _source(path=str(path), layout="verl").take(3)
    assert [p.index for p in prompts] == [0, 1, 2]
    p = prompts[1]
    assert p.messages == rows[1]["prompt"]
    assert p.text == "What is 1 + 1?"  # the last user turn
    assert p.label == "2"
    assert p.metadata == {"data_source": "openai/gsm8k", "ability": "math", "extra_info": {"split": "train", "index": 1}}


def test_slime_jsonl_with_input_and_label_keys(tmp_path):
    path = _jsonl(tmp_path / "data.jsonl", [{"input": "2+3=", "label": 5, "metadata": {"level": 1}},
                                            {"input": "7-4=", "label": 3, "metadata": {"level": 2}}])
    prompts = _source(path=path, layout="slime").take(2)
    assert [(p.text, p.label, p.messages) for p in prompts] == [("2+3=", "5", None), ("7-4=", "3", None)]
    assert prompts[0].metadata == {"metadata": {"level": 1}}


def test_keys_override_the_layout(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": {"value": 2}, "id": "q0"}])
    (p,) = _source(path=path, prompt_key="question", label_key="answer.value", metadata_keys=["id"]).take(1)
    assert (p.text, p.label, p.metadata) == ("1+1=", "2", {"id": "q0"})


def test_trl_plain_and_conversational_prompts(tmp_path):
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps([{"prompt": [{"role": "user", "content": "Say hi."}], "solution": "hi", "topic": "greet"}]))
    (p,) = _source(path=str(conv), layout="trl", label_key="solution").take(1)
    assert p.messages == [{"role": "user", "content": "Say hi."}]
    assert p.label == "hi" and p.metadata == {"topic": "greet"}  # every other column
    plain = _jsonl(tmp_path / "plain.jsonl", [{"prompt": "The sky is", "topic": "nature"}])
    (p,) = _source(path=plain, layout="trl").take(1)
    assert (p.text, p.label, p.messages, p.metadata) == ("The sky is", None, None, {"topic": "nature"})


def test_save_to_disk_directory_with_train_and_eval_splits(tmp_path):
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"prompt": f"q{i}", "label": f"a{i}"} for i in range(4)]),
        "test": datasets.Dataset.from_list([{"prompt": "t0", "label": "b0"}]),
    })
    dd.save_to_disk(str(tmp_path / "ds"))
    train = _source(path=str(tmp_path / "ds"), eval_split="test").take(4)
    assert [(p.text, p.label) for p in train] == [(f"q{i}", f"a{i}") for i in range(4)]
    evals = _source("eval", path=str(tmp_path / "ds"), eval_split="test").take(10)
    assert [(p.text, p.label) for p in evals] == [("t0", "b0")]  # each eval row once


def test_glob_of_files_and_separate_eval_file(tmp_path):
    _jsonl(tmp_path / "part-0.jsonl", [{"prompt": "a", "label": "1"}])
    _jsonl(tmp_path / "part-1.jsonl", [{"prompt": "b", "label": "2"}])
    ev = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "e", "label": "3"}])
    glob = str(tmp_path / "part-*.jsonl")
    assert [p.text for p in _source(path=glob, eval_path=ev).take(2)] == ["a", "b"]
    assert [p.text for p in _source("eval", path=glob, eval_path=ev).take(5)] == ["e"]


def test_held_out_fraction_is_disjoint_and_independent_of_the_seed(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "label": str(i)} for i in range(20)])
    train = {p.text for p in _source(path=path, eval_fraction=0.25).take(15)}
    evals = {p.text for p in _source("eval", path=path, eval_fraction=0.25).take(100)}
    assert len(train) == 15 and len(evals) == 5 and not train & evals
    assert evals == {p.text for p in _source("eval", seed=9, path=path, eval_fraction=0.25).take(100)}


def test_directory_of_data_files_reads_its_named_split(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    _jsonl(d / "train.jsonl", [{"prompt": "tr", "label": "1"}])
    _jsonl(d / "test.jsonl", [{"prompt": "te", "label": "2"}])
    assert [p.text for p in _source(path=str(d)).take(1)] == ["tr"]
    assert [p.text for p in _source("eval", path=str(d), eval_split="test").take(3)] == ["te"]


def test_hub_id_from_the_local_cache_without_network(tmp_path):
    """A hub dataset loaded once online leaves `<HF_DATASETS_CACHE>/<namespace>___<name>/<config>/
    <version>/<hash>/` with its arrow files; miles reads it by hub id with the network off."""
    import glob
    import os
    import shutil
    import subprocess
    import sys

    rows = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}])
    datasets.load_dataset("json", data_files=[rows], cache_dir=str(tmp_path / "build"))
    (info,) = glob.glob(str(tmp_path / "build" / "json" / "*" / "*" / "*" / "dataset_info.json"))
    built = os.path.dirname(info)
    cached = tmp_path / "cache" / "acme___arith" / "default" / "0.0.0" / os.path.basename(built)
    shutil.copytree(built, cached)
    (cached / "json-train.arrow").rename(cached / "arith-train.arrow")  # as the hub builder names it
    code = ("import json; from miles.data.loading import load_rows; "
            "print(json.dumps(load_rows('acme/arith', 'train')))")
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_DATASETS_OFFLINE", None)  # miles turns offline mode on by itself
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [{"prompt": "1+1=", "label": "2"},
                                                               {"prompt": "2+2=", "label": "4"}]
