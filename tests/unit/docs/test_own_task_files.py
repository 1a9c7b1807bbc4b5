"""examples/own_task/ as committed: its data files are what its seeded make_data.py writes, its
configs load with the dataset and the reward file, and the reward scores as its docstring says."""

import filecmp
import runpy
from pathlib import Path

from miles.config import load_config
from miles.run_config import RunConfig
from miles.rewards.contract import RewardInput, load_reward

ROOT = Path(__file__).resolve().parents[3]
HERE = ROOT / "examples" / "own_task"


def test_committed_rows_are_what_make_data_writes(tmp_path):
    runpy.run_path(str(HERE / "make_data.py"))["main"](tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):
        assert filecmp.cmp(tmp_path / name, HERE / name, shallow=False), name


def test_configs_load_with_the_dataset_and_the_reward_file(monkeypatch):
    monkeypatch.chdir(ROOT)
    for name in ("sft.toml", "grpo.toml"):
        cfg = load_config(RunConfig, str(HERE / name), {"model.path": "unused"})
        data = cfg.rollout.task.data
        assert (cfg.rollout.task.name, data.layout) == ("dataset", "slime")
        assert (data.path, data.eval_path) == ("examples/own_task/train.jsonl", "examples/own_task/eval.jsonl")
    reward = load_reward(cfg.rollout.reward)
    assert reward.takes_sample and not reward.batched

    def score(response, label="14"):
        return reward.fn(RewardInput(prompt="digit sum of 482", response=response, response_ids=[], prompt_ids=[],
                                     label=label, metadata={"number": 482}, group=[]))

    assert score("14") == {"score": 1.0, "numeric": 1.0, "off_by": 0.0}
    assert score(" 11") == {"score": 0.0, "numeric": 1.0, "off_by": 3.0}
    assert score("fourteen") == {"score": 0.0, "numeric": 0.0, "off_by": 0.0}
