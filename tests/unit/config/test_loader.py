"""Config loading: TOML + dotted overrides into typed dataclasses, and refusals that name the fix."""

import json

import pytest

from miles.config import ConfigError, load_config, parse_overrides
from miles.config.loader import save_config
from miles.run_config import RunConfig


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    return str(d)


def write(tmp_path, text):
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


def test_toml_and_overrides_build_typed_nested_config(tmp_path, model_dir):
    p = write(tmp_path, f"""
[model]
path = "{model_dir}"
[rollout]
n_samples_per_prompt = 4
temperature = 0.9
[rollout.task]
digits = 3
[trainer.algorithm]
clip_eps_high = 0.28
""")
    cfg = load_config(RunConfig, p, parse_overrides(["--rollout.n_samples_per_prompt", "16", "--loop.num_steps=7",
                                                      "--sync.dtype", "bfloat16", "--placement.pin_cpus", "false"]))
    assert cfg.rollout.n_samples_per_prompt == 16          # CLI wins over TOML
    assert cfg.rollout.temperature == 0.9
    assert cfg.rollout.task.digits == 3
    assert cfg.trainer.algorithm.clip_eps_high == 0.28
    assert cfg.loop.num_steps == 7
    assert cfg.sync.dtype == "bfloat16"
    assert cfg.placement.pin_cpus is False
    assert cfg.trainer.lr == 1e-4                           # untouched defaults stay


def test_resolved_config_round_trips_through_json(tmp_path, model_dir):
    cfg = load_config(RunConfig, None, {"model.path": model_dir, "rollout.top_p": "0.5"})
    save_config(cfg, tmp_path / "config.json")
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["rollout"]["top_p"] == 0.5
    assert data["trainer"]["algorithm"]["name"] == "grpo"


@pytest.mark.parametrize("text, overrides, needle", [
    ("[rollout]\nn_samples = 4\n", {}, "unknown key 'rollout.n_samples'"),
    ("[rolout]\n", {}, "unknown key 'rolout'"),
    ("", {"rollout.n_samples_per_prompt": "eight"}, "rollout.n_samples_per_prompt: expected an integer"),
    ("[rollout]\ntemperature = \"hot\"\n", {}, "rollout.temperature: expected a number"),
    ("", {"loop.schedule": "eventually"}, "loop.schedule: unknown schedule 'eventually': choose one of ['fully_async'"),
    ("", {"rollout.temperature": "0"}, "rollout.temperature must be > 0"),
    ("", {"sync.transport": "pigeon"}, "sync.transport 'pigeon' is unknown"),
    ("", {"trainer.algorithm.name": "magic"}, "trainer.algorithm.name 'magic' is unknown"),
    ("", {"rollout.reward": "nope"}, "unknown reward 'nope'"),
    ("", {"rollout.task.ops": "*"}, "rollout.task.ops must use only"),
    ("", {"rollout": "3"}, "is a section"),
    ("[rollout]\ntemperature = nan\n", {}, "finite"),
])
def test_bad_settings_fail_at_load_naming_the_key(tmp_path, model_dir, text, overrides, needle):
    p = write(tmp_path, f'[model]\npath = "{model_dir}"\n' + text)
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, p, overrides)
    assert needle in str(e.value)


def test_missing_model_dir_names_init_model(tmp_path):
    with pytest.raises(ConfigError, match="miles init-model"):
        load_config(RunConfig, None, {"model.path": str(tmp_path / "absent")})
    with pytest.raises(ConfigError, match="model.path is required"):
        load_config(RunConfig, None, {})


def test_bad_toml_and_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(RunConfig, write(tmp_path, "[model\n"))
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--loop.num_steps"])
    with pytest.raises(ConfigError, match="overrides look like"):
        parse_overrides(["loop.num_steps", "3"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(RunConfig, tmp_path / "nope.toml")


def test_loading_a_run_config_imports_no_server_or_tensor_library(tmp_path, model_dir):
    """`miles train --help`, config checks and tools that only read a config stay light."""
    import subprocess
    import sys

    code = ("import sys\nfrom miles.config import load_config\nfrom miles.run_config import RunConfig\n"
            f"load_config(RunConfig, None, {{'model.path': {model_dir!r}}})\n"
            f"load_config(RunConfig, None, {{'model.path': {model_dir!r}, 'rollout.task.name': 'dataset', "
            "'rollout.task.data.path': 'rows.jsonl', 'rollout.task.data.layout': 'verl'})\n"
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'torch', 'ray', 'transformers', 'datasets', 'pyarrow') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-600:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("overrides, needle", [
    ({"rollout.generate_fn": "harness", "rollout.agent.harness.command": "python my_agent.py"},
     "only single-turn generation and agent episodes carry images"),
    ({"trainer.algorithm.name": "ppo", "trainer.pack_sequences": "false"}, "needs a critic"),
    ({"rollout.return_routed_experts": "true", "trainer.routing_replay": "true"}, "dense 'qwen2_5_vl' model"),
])
def test_what_a_vision_language_policy_is_not_served_with_is_refused_at_load(tiny_vl_model_dir, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(RunConfig, None, {"model.path": tiny_vl_model_dir, **overrides})
    load_config(RunConfig, None, {"model.path": tiny_vl_model_dir})  # single-turn GRPO is served
    load_config(RunConfig, None, {"model.path": tiny_vl_model_dir, "rollout.generate_fn": "agent"})  # and agents


def test_pack_sequences_takes_true_false_or_auto_from_toml_and_the_command_line():
    from miles.config.loader import build
    from miles.trainer.config import TrainerConfig

    assert TrainerConfig().pack_sequences == "auto"
    for cli, want in (("true", True), ("false", False), ("auto", "auto"), ("True", True)):
        assert load_config(RunConfig, None, {"trainer.pack_sequences": cli},
                           validate=False).trainer.pack_sequences == want
    assert build(TrainerConfig, {"pack_sequences": True}).pack_sequences is True
    with pytest.raises(ConfigError, match=r"trainer.pack_sequences: 'sometimes' is not one of False, True, 'auto'"):
        load_config(RunConfig, None, {"trainer.pack_sequences": "sometimes"}, validate=False)
    with pytest.raises(ConfigError, match=r"pack_sequences: 1 is not one of False, True, 'auto'"):
        build(TrainerConfig, {"pack_sequences": 1})  # an integer from TOML is not a bool
