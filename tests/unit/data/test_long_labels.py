"""Labels that cannot fit the response budget they are generated under are refused before a run
starts, with the numbers (how many, the longest and where, the setting to change), or let through
with a warning when the task allows them; SFT refuses them too, and the shipped examples pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import load_config
from miles.data.preflight import check_labels
from miles.models.loading import load_tokenizer
from miles.orchestration.driver import check_data
from miles.run_checks import label_budgets
from miles.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[3]
LONG = "the answer is one hundred and twenty three"


def _rows(path: Path, labels: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": f"question {i}", "label": label}) + "\n"
                            for i, label in enumerate(labels)))
    return str(path)


def _dataset_run(tmp_path, model_dir, **overrides) -> RunConfig:
    train = _rows(tmp_path / "train.jsonl", ["7", LONG, "12 apples"])
    held_out = _rows(tmp_path / "eval.jsonl", ["8", "9"])
    return load_config(RunConfig, None, {"model.path": model_dir, "rollout.task.name": "dataset",
                                         "rollout.task.data.path": train, "rollout.task.data.eval_path": held_out,
                                         "rollout.max_new_tokens": "3", **overrides})


def test_a_label_longer_than_max_new_tokens_is_refused_at_preflight_with_its_numbers(tmp_path, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    longest = len(tok(LONG, add_special_tokens=False).input_ids)
    over = sum(len(tok(label, add_special_tokens=False).input_ids) > 3 for label in ["7", LONG, "12 apples"])
    assert longest > 3 and over == 2  # the numbers the message must carry
    with pytest.raises(SystemExit) as e:
        check_data(_dataset_run(tmp_path, tiny_model_dir))
    text = str(e.value)
    assert (f"2 of 3 train labels take more tokens than rollout.max_new_tokens = 3; the longest "
            f"({tmp_path / 'train.jsonl'} row 1) is {longest} tokens") in text
    assert f"set rollout.max_new_tokens >= {longest}, or rollout.task.allow_long_labels = true" in text
    # The budget the message names is the fix: at the longest label's length the run starts.
    check_data(_dataset_run(tmp_path, tiny_model_dir, **{"rollout.max_new_tokens": str(longest)}))


def test_eval_labels_are_measured_against_eval_max_new_tokens(tmp_path, tiny_model_dir):
    # arithmetic with 3-digit operands: answers of 3-4 digits, more than one token each here
    cfg = load_config(RunConfig, None, {"model.path": tiny_model_dir, "rollout.task.digits": "3",
                                        "eval.max_new_tokens": "1", "eval.num_prompts": "20"})
    with pytest.raises(SystemExit, match=r"of 20 eval labels take more tokens than eval.max_new_tokens = 1; "
                                         r"the longest \(arithmetic prompt \d+, label '\d+'\) is \d+ tokens"):
        check_data(cfg)


def test_allow_long_labels_runs_anyway_with_a_warning(tmp_path, tiny_model_dir, capsys):
    check_data(_dataset_run(tmp_path, tiny_model_dir, **{"rollout.task.allow_long_labels": "true"}))
    err = capsys.readouterr().err
    assert "warning: 2 of 3 train labels take more tokens than rollout.max_new_tokens = 3" in err
    assert "rollout.task.allow_long_labels = true" in err


def test_sft_refuses_demonstrations_longer_than_max_new_tokens_before_starting(tmp_path, tiny_model_dir):
    train = _rows(tmp_path / "train.jsonl", ["7", LONG, "12 apples"])
    held_out = _rows(tmp_path / "eval.jsonl", ["8", "9"])
    cmd = [sys.executable, "-m", "miles.cli", "sft", "--model.path", tiny_model_dir, "--rollout.task.name", "dataset",
           "--rollout.task.data.path", train, "--rollout.task.data.eval_path", held_out,
           "--rollout.max_new_tokens", "3", "--sft.out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "miles: bad data, nothing started: 2 of 3 train labels" in proc.stderr
    assert not (tmp_path / "out").exists()


def _example_configs() -> list[Path]:
    return sorted((ROOT / "examples").glob("*/*.toml"))


@pytest.mark.parametrize("toml", _example_configs(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_shipped_examples_pass_the_label_check(toml, tmp_path, monkeypatch, tiny_model_dir, tiny_vl_model_dir):
    monkeypatch.chdir(ROOT)  # their data and reward paths are relative to the repository
    overrides = {"model.path": tiny_model_dir}
    if toml.parent.name == "vision":  # run.sh makes the pictures and passes their paths
        subprocess.run([sys.executable, str(ROOT / "examples/vision/make_data.py"), str(tmp_path)], check=True,
                       capture_output=True, cwd=ROOT)
        overrides = {"model.path": tiny_vl_model_dir, "rollout.task.data.path": str(tmp_path / "train.parquet"),
                     "rollout.task.data.eval_path": str(tmp_path / "eval.parquet")}
    if toml.name == "opd.toml":  # run.sh passes the teacher it trains first
        overrides["trainer.algorithm.opd.teacher_path"] = tiny_model_dir
    cfg = load_config(RunConfig, str(toml), overrides)
    budgets = label_budgets(cfg)
    assert bool(budgets) == (cfg.rollout.generate_fn == "single_turn")  # agent labels are not responses
    assert check_labels(budgets, load_tokenizer(cfg.model.path), cfg.run.seed) == []
