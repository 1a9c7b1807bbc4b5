"""The example extensions in docs/extending.md load through the registries a run uses and behave
as the page says; the commands in docs/quickstart.md use settings that exist."""

import asyncio
import shlex
from pathlib import Path

import pytest

from tests.helpers.docs_examples import importable_examples

DOCS = Path(__file__).resolve().parents[3] / "docs"


@pytest.fixture()
def examples(tmp_path):
    with importable_examples("extending.md", tmp_path) as files:
        assert set(files) == {"my_rewards.py", "my_envs.py", "my_generate.py", "my_algorithms.py",
                              "my_transports.py"}
        yield


def test_reward_example_loads_and_gives_partial_credit(examples):
    from miles.rollout.reward import get_reward_fn

    fn = get_reward_fn("my_rewards:partial_credit")
    assert fn(" 42 ", "42") == 1.0
    assert fn("41", "42") == 0.2
    assert fn("-41", "42") == 0.0
    assert fn("forty-two", "42") == 0.0
    assert fn("7", None) == 0.0


def test_environment_example_passes_the_protocol_check_and_plays_an_episode(examples):
    from miles.data.prompts import Prompt
    from miles.rollout.environments import check_environment, get_environment

    check_environment("my_envs:second_chance")
    env = get_environment("my_envs:second_chance")()
    assert env.reset(Prompt(index=0, text="2+3=", label="5")) == "2+3="
    first = env.step("6")
    assert not first.done and first.observation
    second = env.step("5")
    assert second.done and second.reward == 0.5
    env.close()


def test_generate_example_runs_against_a_real_engine(examples, tiny_model_dir):
    import httpx

    from miles.rollout.config import AgentConfig
    from miles.rollout.generate import GenerateContext, get_generate_fn
    from miles.data.prompts import Prompt
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread
    from miles.rollout.generate import SamplingParams
    from miles.models.loading import load_tokenizer

    fn = get_generate_fn("my_generate:with_instruction")
    tok = load_tokenizer(tiny_model_dir)
    server = start_server_thread(EngineConfig(model_path=tiny_model_dir))
    try:
        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                ctx = GenerateContext(client=client, url=server.url, tokenizer=tok,
                                      encode=lambda t: tok(t, add_special_tokens=False).input_ids,
                                      reward_fn=lambda response, label: 1.0, agent=AgentConfig())
                return await fn(ctx, Prompt(index=3, text="2+3=", label="5"),
                                SamplingParams(max_new_tokens=4, seed=1), "doc-example")

        sample = asyncio.run(run())
    finally:
        server.stop()
    prompt_text = tok.decode(sample.prompt_ids)
    assert prompt_text.startswith("Answer with the number only.")
    assert 1 <= len(sample.response_ids) <= 4 and len(sample.rollout_logprobs) == len(sample.response_ids)
    assert sample.reward == 1.0 and sample.prompt_index == 3 and sample.weight_versions


def test_quickstart_commands_use_settings_that_exist(tiny_model_dir):
    from miles.cli import build_parser
    from miles.config import load_config, parse_overrides
    from miles.run_config import RunConfig

    root = DOCS.parent
    commands = [shlex.split(line) for line in (DOCS / "quickstart.md").read_text().splitlines()
                if line.startswith(".venv/bin/miles ") and "--help" not in line]
    subcommands = {c[1] for c in commands}
    assert {"init-model", "sft", "train", "report"} <= subcommands
    parser = build_parser()
    for argv in commands:
        args, extra = parser.parse_known_args(argv[1:])
        if argv[1] in ("train", "sft"):
            assert (root / args.config).is_file(), args.config
            overrides = parse_overrides(extra)
            overrides["model.path"] = tiny_model_dir  # the docs' path does not exist until step 2 runs
            load_config(RunConfig, root / args.config, overrides)


def test_algorithm_example_is_picked_up_from_a_run_config_with_its_own_knob(examples, tiny_model_dir):
    from miles.config import ConfigError, load_config
    from miles.run_config import RunConfig
    from miles.trainer.algorithms import get_algorithm

    cfg = load_config(RunConfig, None, {"model.path": tiny_model_dir,
                                        "trainer.algorithm.name": "my_algorithms:RankAdvantage",
                                        "trainer.algorithm.scale": "0.5"})
    algorithm = get_algorithm(cfg.trainer.algorithm)
    assert algorithm.advantages([0.0, 1.0, 1.0, 3.0]) == [-0.5, 0.0, 0.0, 0.5]
    assert algorithm.advantages([2.0, -7.0]) == [0.5, -0.5]
    with pytest.raises(ConfigError, match="unknown key 'trainer.algorithm.scale'"):
        load_config(RunConfig, None, {"model.path": tiny_model_dir, "trainer.algorithm.scale": "0.5"})
    # It declares itself group-relative, so groups of one sample are refused for it as for GRPO.
    with pytest.raises(ConfigError, match="rollout.n_samples_per_prompt >= 2"):
        load_config(RunConfig, None, {"model.path": tiny_model_dir, "rollout.n_samples_per_prompt": "1",
                                      "trainer.algorithm.name": "my_algorithms:RankAdvantage"})
