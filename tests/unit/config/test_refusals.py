"""Values that cannot run, or that would train silently wrong, are refused at load with the key and the fix.

Each case is a setting a user could plausibly write; before these checks each one either failed only
after Ray and the engines had started, ended in a traceback, or ran and trained something else.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError, load_config
from miles.run_config import RunConfig

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def model_dir(tmp_path):
    """A checkpoint directory as far as config loading reads it: config.json with a 64-token context."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 64}))
    return str(d)


def refusal(overrides: dict[str, str], path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, path, overrides)
    return str(e.value)


@pytest.mark.parametrize("key, value, fix", [
    # top_k: -1 is "off"; the engines read any other value <= 0 as off too, so 0 would silently sample everything.
    ("rollout.top_k", "0", "set -1 (off, the whole vocabulary) or a count >= 1"),
    ("rollout.top_k", "-2", "set -1 (off, the whole vocabulary) or a count >= 1"),
    ("rollout.request_timeout_s", "-1", "set it > 0"),
    ("rollout.engine.num_threads", "-1", "set it >= 1"),
    ("rollout.engine.max_batch_size", "0", ">= 1"),
    ("rollout.engine.weight_update_timeout_s", "-5", "set it > 0"),
    ("rollout.engine.default_max_new_tokens", "0", "set it >= 1"),
    ("rollout.engine.port", "70000", "0..65535"),
    ("trainer.num_threads", "-1", "set it >= 1"),
    ("trainer.micro_batch_size", "0", ">= 1"),
    ("trainer.adam_beta1", "1.5", "AdamW needs a value in [0, 1)"),
    ("trainer.adam_beta2", "1.0", "AdamW needs a value in [0, 1)"),
    ("trainer.adam_beta1", "-0.1", "AdamW needs a value in [0, 1)"),
    ("trainer.weight_decay", "-0.01", "set it >= 0"),
    ("trainer.grad_clip", "-1", "or 0 to turn clipping off"),
    ("trainer.collective_timeout_s", "-1", "> 0"),
    ("ray.num_cpus", "0", "set it >= 1"),
    ("ray.detached_engines", "true", "needs a cluster that outlives the driver: set ray.address"),
    ("ray.engine_lease_s", "0", "set it > 0"),
    ("router.request_timeout_s", "0", "set it > 0"),
    ("sft.batch_size", "0", "sft.batch_size >= 1"),
    ("loop.collect_timeout_s", "-3", "> 0"),
    ("health.timeout_s", "-1", "> 0"),
    ("sync.timeout_s", "-1", "> 0"),
    ("eval.max_new_tokens", "0", "set it >= 1"),
    ("rollout.engine.tool_call_parser", "bogus", "choose one of hermes"),
    ("placement.release_memory", "weights,gpu", "use weights, kv_cache or both"),
])
def test_impossible_values_are_refused_naming_key_and_fix(model_dir, key, value, fix):
    msg = refusal({"model.path": model_dir, key: value})
    assert key.split(".")[-1] in msg and fix in msg, msg


def test_standby_engines_with_engines_the_run_did_not_start_are_refused(model_dir):
    msg = refusal({"model.path": model_dir, "rollout.engine_urls": "http://127.0.0.1:30000",
                   "health.standby_engines": "1"})
    assert "health.standby_engines" in msg and "set health.standby_engines = 0" in msg, msg


def test_top_k_off_and_positive_still_load(model_dir):
    assert load_config(RunConfig, None, {"model.path": model_dir, "rollout.top_k": "-1"}).rollout.top_k == -1
    assert load_config(RunConfig, None, {"model.path": model_dir, "rollout.top_k": "20"}).rollout.top_k == 20


def test_eval_set_top_k_zero_is_refused(tmp_path, model_dir):
    p = tmp_path / "run.toml"
    p.write_text(f'[model]\npath = "{model_dir}"\n[[eval.sets]]\nname = "held"\ntop_k = 0\n')
    msg = refusal({}, p)
    assert "eval.sets[0] (held).top_k = 0" in msg and "set -1" in msg


@pytest.mark.parametrize("key", ["rollout.max_new_tokens", "eval.max_new_tokens"])
def test_response_budget_beyond_the_model_context_is_refused(model_dir, key):
    msg = refusal({"model.path": model_dir, key: "64"})
    assert f"{key} = 64 leaves no room for a prompt" in msg and "max_position_embeddings (64 tokens)" in msg
    assert f"set {key} <= 63" in msg
    load_config(RunConfig, None, {"model.path": model_dir, key: "63"})  # the largest budget that fits


def test_budget_is_measured_against_a_configured_engine_context(model_dir):
    msg = refusal({"model.path": model_dir, "rollout.engine.context_length": "32", "rollout.max_new_tokens": "40"})
    assert "rollout.max_new_tokens = 40" in msg and "rollout.engine.context_length (32 tokens)" in msg
    msg = refusal({"model.path": model_dir, "rollout.engine.context_length": "128"})
    assert "beyond the model's max_position_embeddings (64)" in msg


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp_baseline"])
def test_group_relative_algorithm_with_groups_of_one_is_refused(model_dir, algorithm):
    msg = refusal({"model.path": model_dir, "trainer.algorithm.name": algorithm,
                   "rollout.n_samples_per_prompt": "1"})
    assert f"trainer.algorithm.name = {algorithm!r}" in msg and "set rollout.n_samples_per_prompt >= 2" in msg


@pytest.mark.parametrize("algorithm", ["reinforce_pp", "ppo"])
def test_algorithms_without_a_group_baseline_take_groups_of_one(model_dir, algorithm):
    cfg = load_config(RunConfig, None, {"model.path": model_dir, "trainer.algorithm.name": algorithm,
                                        "rollout.n_samples_per_prompt": "1"})
    assert cfg.rollout.n_samples_per_prompt == 1


@pytest.mark.parametrize("content, needle", [
    ("{}", "names no model_type"),
    ("[1, 2]", "names no model_type"),
    ('{"model_type": "qwen3"', "is not valid UTF-8 JSON"),
    (b"\xff\xfe{}", "is not valid UTF-8 JSON"),
])
def test_model_directory_with_an_unusable_config_json_is_refused(tmp_path, content, needle):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    msg = refusal({"model.path": str(d)})
    assert msg.startswith("model.path: ") and needle in msg and "config.json" in msg


def test_model_directory_without_config_json_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    assert "has no config.json" in refusal({"model.path": str(tmp_path / "m")})


def test_non_utf8_toml_is_refused_with_a_message(tmp_path, model_dir):
    p = tmp_path / "run.toml"
    p.write_bytes(f'[model]\npath = "{model_dir}"\n[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    msg = refusal({}, p)
    assert "not UTF-8" in msg and "save the file as UTF-8" in msg and str(p) in msg


def test_config_path_that_is_a_folder_is_refused(tmp_path):
    assert "is a folder" in refusal({}, tmp_path)


def test_json_config_that_is_not_a_table_is_refused(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("[1]")
    assert "not a table of settings" in refusal({}, p)


@pytest.mark.parametrize("output_dir", ["afile", "afile/runs"])
def test_output_dir_that_is_a_file_is_refused(tmp_path, model_dir, output_dir):
    (tmp_path / "afile").write_text("x")
    msg = refusal({"model.path": model_dir, "run.output_dir": str(tmp_path / output_dir)})
    assert "run.output_dir" in msg and "is a file, not a folder" in msg


def test_output_dir_that_does_not_exist_yet_loads(tmp_path, model_dir):
    cfg = load_config(RunConfig, None, {"model.path": model_dir, "run.output_dir": str(tmp_path / "new" / "runs")})
    assert cfg.run.output_dir.endswith("runs")


def test_run_name_with_a_slash_is_refused(model_dir):
    assert "must be one folder name" in refusal({"model.path": model_dir, "run.name": "../escape"})


def test_miles_train_answers_bad_configs_with_a_message_not_a_traceback(tmp_path, model_dir):
    """The command a user runs: each bad config exits nonzero with one `miles: config error:` line."""
    (tmp_path / "afile").write_text("x")
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    empty_model = tmp_path / "empty"
    empty_model.mkdir()
    (empty_model / "config.json").write_text("{}")
    cases = [
        ([str(latin1), "--model.path", model_dir], "not UTF-8"),
        (["--model.path", model_dir, "--run.output_dir", str(tmp_path / "afile")], "is a file, not a folder"),
        (["--model.path", str(empty_model)], "names no model_type"),
        (["--model.path", model_dir, "--rollout.top_k", "0"], "rollout.top_k = 0"),
        (["--model.path", model_dir, "--rollout.max_new_tokens", "100"], "leaves no room for a prompt"),
        (["--model.path", model_dir, "--rollout.n_samples_per_prompt", "1"], "rollout.n_samples_per_prompt >= 2"),
        (["--model.path", model_dir, "--trainer.adam_beta1", "1.5"], "trainer.adam_beta1 = 1.5"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for argv, needle in cases:
        r = subprocess.run([sys.executable, "-m", "miles.cli", "train", *argv], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=120)
        assert r.returncode != 0, argv
        assert "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("miles: config error:") and needle in r.stderr, (argv, r.stderr)
        assert not (tmp_path / "runs").exists()  # nothing started, no run directory made


@pytest.mark.parametrize("overrides, needle", [
    ({"fault.kill_router_at_steps": "3", "router.own_process": "false"}, "needs router.own_process = true"),
    ({"fault.drop_response_prob": "0.1", "router.own_process": "true"}, "set router.own_process = false"),
    ({"fault.kill_engine_at_steps": "2", "health.restart": "false"}, "need health.enabled = true"),
    ({"fault.stall_engine_at_steps": "2", "health.restart": "false"}, "need health.enabled = true"),
    ({"fault.corrupt_delta_at_steps": "2"}, "writes none: set sync.transport = 'disk_delta'"),
    ({"fault.kill_driver_at_step": "3", "loop.save_every": "2", "loop.num_steps": "6"},
     "fault.kill_driver_at_step = 3 fires once that step's checkpoint is written"),
])
def test_faults_the_run_could_not_survive_or_inject_are_refused(model_dir, overrides, needle):
    assert needle in refusal({"model.path": model_dir, **overrides})


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_packing_is_refused_for_models_whose_layers_carry_recurrent_state(preset, preset_dir):
    path = str(preset_dir(preset))
    message = refusal({"model.path": path, "trainer.pack_sequences": "true"})
    assert "linear_attention layers carry recurrent state" in message and "set trainer.pack_sequences = false" in message
    load_config(RunConfig, None, {"model.path": path})  # unpacked, the same model is taken
