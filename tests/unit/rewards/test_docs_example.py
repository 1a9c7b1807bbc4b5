"""The reward file in docs/rewards.md works from a run config as the page says, and the group
generator hands samples to the runner unless their generate function scores them itself."""

from __future__ import annotations

import asyncio
import threading

import pytest

from miles.buffer.types import Sample
from miles.config import load_config
from miles.run_config import RunConfig
from miles.rewards.runner import RewardRunner
from tests.helpers.docs_examples import importable_examples


@pytest.fixture()
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    return str(d)


def _sample(text, ids=3, label="1/2"):
    return Sample(prompt_ids=[1], response_ids=[5] * ids, rollout_logprobs=[0.0] * ids, loss_mask=[1] * ids,
                  response_text=text, label=label)


def test_docs_reward_file_scores_through_a_run_config(tmp_path, model_dir):
    with importable_examples("rewards.md", tmp_path) as files:
        assert set(files) == {"my_task_rewards.py"}
        path = tmp_path / "my_task_rewards.py"
        cfg = load_config(RunConfig, None, {"model.path": model_dir, "rollout.reward": f"{path}:correct_and_boxed",
                                            "rollout.reward_config.timeout_s": "10"})
        runner = RewardRunner(cfg.rollout.reward, cfg.rollout.reward_config)
        samples = [_sample("\\boxed{0.5}"), _sample("0.5"), _sample("\\boxed{2}")]
        asyncio.run(runner.score_group(samples))
        assert [s.reward for s in samples] == [1.1, 1.0, 0.1]
        # its `correct` is read: the wrong but boxed answer scores 0.1 and is not correct
        assert [s.correct for s in samples] == [True, True, False]
        m = runner.take_metrics()
        assert m["reward/correct"] == pytest.approx(2 / 3) and m["reward/boxed"] == pytest.approx(2 / 3)

        group = RewardRunner(f"{path}:shortest_correct")
        samples = [_sample("\\boxed{0.5}", ids=4), _sample("1/2", ids=2), _sample("3", ids=1)]
        asyncio.run(group.score_group(samples))
        assert [s.reward for s in samples] == [0.5, 1.0, 0.0]
        runner.close(), group.close()


@pytest.mark.parametrize("scores_itself", [True, False])
def test_a_generate_function_may_leave_scoring_to_the_runner(scores_itself):
    from miles.rollout.config import RolloutConfig
    from miles.data.prompts import Prompt
    from miles.engine_api.client import EngineClient
    from miles.rollout.group import GroupGenerator

    async def my_generate(ctx, prompt, params, rid):
        s = _sample(prompt.label, label=prompt.label)
        s.reward = 7.0  # a generate function that fills in its own reward keeps it
        return s

    my_generate.scores_itself = scores_itself
    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return type("Encoded", (), {"input_ids": [ord(c) for c in text]})()

    gen = GroupGenerator(RolloutConfig(n_samples_per_prompt=2), 0, Tokenizer(), RewardRunner("exact_match"), my_generate,
                         None,
                         EngineClient(["http://127.0.0.1:1"]), threading.Event())
    group = asyncio.run(gen.generate_group(None, Prompt(index=0, text="1+1=", label="2")))
    assert group.rewards == ([7.0, 7.0] if scores_itself else [1.0, 1.0])
    assert gen.take_stats(1.0)["reward/calls"] == (0 if scores_itself else 2)
