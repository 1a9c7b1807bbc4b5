"""The reward contract: a user reward file (sync, async, batched, dict-valued, legacy two-argument,
group-level) named in a run config is loaded, checked at load time and scores samples."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from miles.buffer.types import Sample
from miles.config import ConfigError, load_config
from miles.run_config import RunConfig
from miles.rewards.runner import RewardRunner

USER_REWARDS = '''
import asyncio

def legacy(response, label):
    return float(response.strip() == label)

def per_sample(sample):
    return {"score": float(sample.response.strip() == sample.label), "length": len(sample.response_ids),
            "tagged": float(sample.metadata.get("source") == "gsm8k")}

async def slow_ok(sample):
    await asyncio.sleep(0.01)
    return 1.0 if sample.prompt.startswith("Q:") else 0.0

def lists(responses, labels):
    return [float(r == l) for r, l in zip(responses, labels)]
lists.batched = True

async def group_rank(samples):
    # group-level: the longest response of the group scores 1
    longest = max(len(s.response) for s in samples)
    return [float(len(s.response) == longest and s.group is samples) for s in samples]
group_rank.batched = True

def three_args(a, b, c):
    return 0.0
'''


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(textwrap.dedent(USER_REWARDS))
    return path


def _samples(texts, label="42"):
    return [Sample(prompt_ids=[1, 2], response_ids=list(range(len(t))), rollout_logprobs=[0.0] * len(t),
                   loss_mask=[1] * len(t), response_text=t, label=label) for t in texts]


@pytest.fixture(autouse=True)
def model_dir(tmp_path, monkeypatch):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    monkeypatch.setattr(_HERE, "MODEL", str(d))


class _HERE:
    MODEL = ""


def run_config(over=None, path=None):
    """A run config as `miles train` loads it, with a stand-in model directory."""
    return load_config(RunConfig, path, {"model.path": _HERE.MODEL, **(over or {})})


def _runner_from_config(spec, **over):
    cfg = run_config({"rollout.reward": spec, **over})
    return RewardRunner(cfg.rollout.reward, cfg.rollout.reward_config)


@pytest.mark.parametrize("fn, expected", [("legacy", [1.0, 0.0, 0.0]), ("per_sample", [1.0, 0.0, 0.0]),
                                          ("slow_ok", [1.0, 1.0, 1.0]), ("lists", [0.0, 0.0, 1.0]),
                                          ("group_rank", [0.0, 0.0, 1.0])])
def test_user_reward_file_from_run_config_scores_samples(reward_file, fn, expected):
    runner = _runner_from_config(f"{reward_file}:{fn}")
    samples = _samples([" 42", "41", "42 and more"], label="42")
    if fn == "lists":
        samples = _samples(["4", "41", "42"], label="42")
    keep = asyncio.run(runner.score_group(samples, "Q: 6*7?", {"source": "gsm8k"}))
    assert keep and [s.reward for s in samples] == expected
    m = runner.take_metrics()
    assert m["reward/errors"] == 0 and m["reward/timeouts"] == 0
    assert m["reward/calls"] == (1 if fn in ("lists", "group_rank") else 3)
    if fn == "per_sample":  # a dict's extra numbers are logged as step means under reward/<key>
        assert m["reward/length"] == pytest.approx((3 + 2 + 11) / 3) and m["reward/tagged"] == 1.0
    runner.close()


def test_module_function_spec_and_legacy_view(reward_file, monkeypatch):
    monkeypatch.syspath_prepend(str(reward_file.parent))
    from miles.rollout.reward import get_reward_fn

    fn = get_reward_fn("user_rewards:per_sample")  # the (response, label) view evaluation calls
    assert fn("42", "42") == 1.0 and fn("7", "42") == 0.0
    assert get_reward_fn("user_rewards:lists")("42", "42") == 1.0


@pytest.mark.parametrize("spec, message", [
    ("{file}:three_args", "takes 3 required positional arguments"),
    ("{file}:missing", "defines no 'missing'"),
    ("/nonexistent/r.py:f", "no file"),
    ("nope", "unknown reward 'nope'"),
    ("weighted", "reward_config.weights"),
    ("regex", "regex_pattern"),
])
def test_bad_rewards_fail_at_load_time_naming_the_fix(reward_file, spec, message):
    with pytest.raises(ConfigError, match="rollout.reward") as e:
        run_config({"rollout.reward": spec.format(file=reward_file)})
    assert message in str(e.value)


def test_weighted_combination_of_builtins_logs_each_component(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[rollout]\nreward = "weighted"\n[rollout.reward_config]\n'
                    'weights = { math = 0.75, regex = 0.25 }\nregex_pattern = \'\\\\boxed\\{.*\\}$\'\n')
    cfg = run_config(path=toml)
    runner = RewardRunner(cfg.rollout.reward, cfg.rollout.reward_config)
    samples = _samples(["so \\boxed{1/2}", "0.5", "\\boxed{3}"], label="0.5")
    asyncio.run(runner.score_group(samples))
    assert [s.reward for s in samples] == [1.0, 0.75, 0.25]
    # math judges the answer and regex only its form: the verdict is math's (a boxed 3 is wrong).
    assert [s.correct for s in samples] == [True, True, False]
    m = runner.take_metrics()
    assert m["reward/math"] == pytest.approx(2 / 3) and m["reward/regex"] == pytest.approx(2 / 3)
    runner.close()


def test_legacy_view_works_inside_a_running_event_loop(reward_file):
    """ctx.reward_fn is called from generate functions, on the rollout's event loop."""
    from miles.rollout.reward import get_reward_fn

    fn = get_reward_fn(f"{reward_file}:slow_ok")

    async def main():
        return [fn("x", "y") for _ in range(12)]

    assert asyncio.run(main()) == [0.0] * 12  # the prompt is empty here: slow_ok gives 0
