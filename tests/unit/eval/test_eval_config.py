"""Eval sets in a run config: [[eval.sets]] tables load with their defaults, the old [eval] keys keep
working, and bad sets are refused naming the key."""

import pytest

from miles.config import ConfigError, load_config
from miles.run_config import RunConfig


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    return str(d)


def load(tmp_path, model_dir, text):
    p = tmp_path / "run.toml"
    p.write_text(f'[model]\npath = "{model_dir}"\n' + text)
    return load_config(RunConfig, p)


def test_eval_sets_load(tmp_path, model_dir):
    cfg = load(tmp_path, model_dir, """
[eval]
every_steps = 5
num_prompts = 32
max_new_tokens = 8

[[eval.sets]]
name = "arith3"
n = 8
k = [1, 4, 8]
temperature = 0.7
top_p = 0.9
max_new_tokens = 12
answer = "last_number"
reward = "exact_match"
task = { name = "arithmetic", digits = 3 }

[[eval.sets]]
name = "quick"
""")
    assert (cfg.eval.every_steps, cfg.eval.num_prompts, cfg.eval.max_new_tokens) == (5, 32, 8)
    a, q = cfg.eval.sets
    assert a.name == "arith3" and a.n == 8 and a.ks == [1, 4, 8] and a.task.digits == 3
    assert (a.temperature, a.top_p, a.max_new_tokens, a.answer) == (0.7, 0.9, 12, "last_number")
    assert q.task is None and q.reward == "" and q.ks == [1, q.n] and q.metrics == ["pass", "avg", "maj"]


def test_a_config_without_sets_is_unchanged(tmp_path, model_dir):
    cfg = load(tmp_path, model_dir, "[eval]\nnum_prompts = 16\n")
    assert cfg.eval.sets == [] and cfg.eval.num_prompts == 16


@pytest.mark.parametrize("table,needle", [
    ('name = "a"\nk = [5]\nn = 4', r"eval.sets\[0\] \(a\).k: 5 is outside 1..n"),
    ('name = "a"\nmetrics = ["pass", "best"]', r"eval.sets\[0\] \(a\).metrics: unknown metric 'best'"),
    ('name = "a"\nanswer = "nope"', r"eval.sets\[0\] \(a\).answer: unknown answer extractor"),
    ('name = "a"\nreward = "nope"', r"eval.sets\[0\] \(a\).reward: unknown reward"),
    ('n = 2', r"eval.sets\[0\].name: give each eval set a name"),
    ('name = "a b"', r"eval.sets\[0\] \(a b\).name"),
    ('name = "a"\ntemperature = 0.0', r"eval.sets\[0\] \(a\).temperature must be > 0 when n > 1"),
    ('name = "a"\nn = 0\ngreedy = false', r"eval.sets\[0\] \(a\): n = 0 and greedy = false"),
    ('name = "a"\ntask = { digits = 12 }', r"eval.sets\[0\] \(a\).task: rollout.task.digits"),
    ('name = "a"\nbogus = 1', r"unknown key 'eval.sets\[0\].bogus'"),
])
def test_bad_sets_are_refused_naming_the_key(tmp_path, model_dir, table, needle):
    with pytest.raises(ConfigError, match=needle):
        load(tmp_path, model_dir, "[[eval.sets]]\n" + table + "\n")


def test_duplicate_set_names_are_refused(tmp_path, model_dir):
    with pytest.raises(ConfigError, match=r"eval.sets\[1\] \(a\).name: 'a' names two eval sets"):
        load(tmp_path, model_dir, '[[eval.sets]]\nname = "a"\n[[eval.sets]]\nname = "a"\n')
