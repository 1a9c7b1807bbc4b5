"""Environments: the registry, its load-time checks, and the built-ins (calculator, terminal)."""

from __future__ import annotations

import pytest

from miles.config import ConfigError
from miles.data.prompts import Prompt
from miles.rollout.config import AgentConfig, RolloutConfig
from miles.rollout.environments import check_environment, get_environment
from miles.rollout.environments.sandbox import SandboxConfig, SandboxUnavailable, check_available
from miles.rollout.environments.terminal import TASKS, TerminalEnv, TerminalTaskSource
from miles.rollout.environments.tool_calc import CalculatorEnv, demonstration, evaluate
from miles.run_checks import check_generate
from miles.run_config import RunConfig


def not_an_env():
    return object()


def needs_args(x):
    return x


def calculator():
    return CalculatorEnv(max_tool_calls=1)


def test_environments_by_name_or_path_are_checked_against_the_protocol():
    check_environment("tool_calc")
    check_environment(f"{__name__}:calculator")  # a user's factory function
    check_environment("miles.rollout.environments.tool_calc:CalculatorEnv")  # a class works as its own factory
    with pytest.raises(ValueError, match="choose one of .*terminal.*tool_calc"):
        get_environment("calculator")
    with pytest.raises(ValueError, match=r"lacks \['reset', 'step', 'close'\]"):
        check_environment(f"{__name__}:not_an_env")
    with pytest.raises(ValueError, match="no arguments"):
        check_environment(f"{__name__}:needs_args")
    with pytest.raises(ConfigError, match="rollout.agent.environment: unknown environment 'nope'"):
        check_generate(RunConfig(rollout=RolloutConfig(agent=AgentConfig(environment="nope"))))


def test_calculator_evaluates_arithmetic_only():
    assert evaluate("12*(3+4)") == "84" and evaluate("7-10") == "-3" and evaluate("17 // 5") == "3"
    assert evaluate("__import__('os').system('id')").startswith("error")
    assert evaluate("2**100000").startswith("error") and evaluate("1//0").startswith("error")
    assert evaluate("9" * 70) == "error: expression too long"
    # The fixed-width layout pads operands with zeros; Python alone would call 07 a syntax error.
    assert evaluate("07+38") == "45" and evaluate("100-007") == "93" and evaluate("0+00") == "0"


def test_calculator_episode_tool_call_then_answer():
    env = CalculatorEnv(max_tool_calls=1)
    task = Prompt(index=0, text="123+456=", label="579")
    assert env.reset(task) == "123+456="
    first = env.step("calc 123+456")
    assert first.observation == "579" and not first.done
    final = env.step(" 579 ")
    assert final.done and final.reward == 1.0
    env.reset(task)
    env.step("calc 1+1")
    # Past the tool budget a call counts as the final answer, and a wrong one.
    assert env.step("calc 123+456").reward == 0.0
    assert [r for r, _ in demonstration(task, use_tool=True)] == ["assistant", "tool", "assistant"]


@pytest.fixture
def sandbox_here():
    """Skips a test that needs the terminal sandbox where this machine cannot run it."""
    try:
        check_available()
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox here: {e}")


@pytest.mark.parametrize("backend", ["root", "rootless"])
def test_terminal_tasks_are_solved_by_their_reference_and_failed_otherwise(backend):
    # The rootless backend's minimal root (/usr and a few /etc files) holds every tool the tasks use.
    try:
        check_available(backend)
    except SandboxUnavailable as e:
        pytest.skip(f"no {backend} sandbox here: {e}")
    env = TerminalEnv(max_commands=3, sandbox_config=SandboxConfig(backend=backend))
    for t in TASKS:
        env.reset(Prompt(index=0, text=t.instruction, label=t.name))
        step = env.step(t.solution)
        assert not step.done and "[exit status" not in step.observation
        done = env.step("done")
        assert done.done and done.reward == 1.0, t.name
        env.reset(Prompt(index=0, text=t.instruction, label=t.name))
        assert env.step("done").reward == 0.0, f"{t.name}: the verifier passes without any work"
    env.close()
    names = {p.answer for p in TerminalTaskSource("train", 0).take(len(TASKS))}
    assert names == {t.name for t in TASKS}
    with pytest.raises(ValueError, match="terminal task 'nope' is unknown"):
        env.reset(Prompt(index=0, text="", label="nope"))


@pytest.mark.usefixtures("sandbox_here")
def test_terminal_episode_ends_after_the_command_budget_with_the_verifier():
    env = TerminalEnv(max_commands=2)
    env.reset(Prompt(index=0, text="", label="hello_file"))
    garbled = env.step("ls\x00")
    assert not garbled.done and "NUL byte" in garbled.observation
    env.reset(Prompt(index=0, text="", label="hello_file"))
    assert not env.step("ls").done
    last = env.step("echo hello > hello.txt")
    assert last.done and last.reward == 1.0
    workdir = env.sandbox.workdir
    env.close()
    assert not workdir.exists()


def test_env_args_and_sandbox_limits_reach_the_environment_from_the_run_config(tiny_model_dir):
    from miles.config import ConfigError, load_config
    from miles.run_config import RunConfig
    from miles.rollout.environments import build_environment

    cfg = load_config(RunConfig, None, {"model.path": tiny_model_dir, "rollout.generate_fn": "agent",
                                        "rollout.agent.environment": "terminal",
                                        "rollout.agent.sandbox.wall_timeout_s": "3.5"})
    agent = cfg.rollout.agent
    agent.env_args = {"max_commands": 2}
    env = build_environment(agent.environment, agent.env_args, agent.sandbox)
    assert env.max_commands == 2 and env.sandbox_config.wall_timeout_s == 3.5
    env.close()
    with pytest.raises(ConfigError, match=r"rollout.agent.sandbox.wall_timeout_s|sandbox.wall_timeout_s must be > 0"):
        load_config(RunConfig, None, {"model.path": tiny_model_dir, "rollout.agent.sandbox.wall_timeout_s": "0"})
    with pytest.raises(ConfigError, match="cannot be built with rollout.agent.env_args"):
        cfg.rollout.agent.env_args = {"no_such_knob": 1}
        check_generate(cfg)


def test_the_terminal_examples_rl_config_runs_episodes_in_the_rootless_sandbox(tiny_model_dir):
    """examples/terminal/grpo.toml: terminal episodes and prompts, commands confined without privilege."""
    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.rollout.environments import build_environment

    cfg = load_config(RunConfig, "examples/terminal/grpo.toml", {"model.path": tiny_model_dir})
    agent = cfg.rollout.agent
    assert cfg.rollout.generate_fn == "agent" and agent.environment == "terminal"
    assert cfg.rollout.task.name == "terminal" and agent.sandbox.backend == "rootless"
    env = build_environment(agent.environment, agent.env_args, agent.sandbox)
    try:
        env.reset(Prompt(index=0, text=TASKS[0].instruction, label=TASKS[0].name))
        assert env.sandbox.backend == "rootless"
        env.step(TASKS[0].solution)
        assert env.step("done").reward == 1.0
    finally:
        env.close()
