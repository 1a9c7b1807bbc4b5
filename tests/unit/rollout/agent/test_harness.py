"""Black-box harnesses: a real program, written against the real `openai` client, run once per
sample against a session in front of a real engine process; the session's tokens become the Sample."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time

import httpx
import pytest

from miles.buffer.types import SampleStatus
from miles.config import ConfigError, load_config
from miles.run_config import RunConfig
from miles.rollout.config import AgentConfig, HarnessConfig
from miles.rollout.generate import GenerateContext, get_generate_fn
from miles.data.prompts import Prompt
from miles.rollout.generate import SamplingParams
from miles.rollout.agent.harness import take_metrics

AGENT = textwrap.dedent('''
    """A tiny agent: asks the model with a calculator tool, runs any call, asks again, reports a reward."""
    import json, os, sys
    import openai

    episode = json.load(open(os.environ["MILES_EPISODE"]))
    assert json.loads(sys.stdin.read()) == episode
    assert "MILES_ENGINE_ADMIN_TOKEN" not in os.environ  # the run's admin token is never handed over
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from miles
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": os.environ["MILES_PROMPT"]}]
    reply = client.chat.completions.create(model="miles", messages=messages, tools=tools, max_tokens=6).choices[0]
    messages.append(reply.message.model_dump(exclude_none=True))
    for call in reply.message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
    if not reply.message.tool_calls:
        messages.append({"role": "tool", "content": "no tool called"})
    final = client.chat.completions.create(model="miles", messages=messages, tools=tools, stream=True)
    answer = "".join(c.choices[0].delta.content or "" for c in final if c.choices)
    print("thinking out loud")
    print(json.dumps({"reward": float(len(answer) % 2), "label": episode["label"]}))
''')


@pytest.fixture(scope="module")
def agent_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("harness") / "agent.py"
    path.write_text(AGENT)
    return str(path)


def run(engine_url, tokenizer, harness: HarnessConfig, *, timeout_s=60.0, max_turns=4, prompt_text="What is 6*7?",
        reward_fn=None, k=0, max_response_tokens=64):
    agent = AgentConfig(harness=harness, episode_timeout_s=timeout_s, max_turns=max_turns,
                        max_response_tokens=max_response_tokens)
    fn = get_generate_fn("harness")

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            ctx = GenerateContext(client, engine_url, tokenizer, None, reward_fn or (lambda r, l: 0.0), agent)
            return await fn(ctx, Prompt(index=7, text=prompt_text, label="42", metadata={"src": "t"}),
                            SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), f"p7-{k}-{time.monotonic_ns()}")

    return asyncio.run(main())


def test_a_program_using_the_openai_client_becomes_a_trained_sample(agent_engine_url, agent_tokenizer, agent_script,
                                                                   monkeypatch):
    monkeypatch.setenv("MILES_ENGINE_ADMIN_TOKEN", "secret")
    take_metrics()
    s = run(agent_engine_url, agent_tokenizer, HarnessConfig(command=f"{sys.executable} {agent_script}"))
    assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), s.metadata
    assert "harness_failure" not in s.metadata and s.metadata["src"] == "t"
    # Two model turns, separated by the tool turn the session rendered: mask 1 only on model tokens.
    assert len(s.weight_versions) == 2
    runs = [m for i, m in enumerate(s.loss_mask) if i == 0 or m != s.loss_mask[i - 1]]
    assert runs == [1, 0, 1] and s.loss_mask[-1] == 1
    assert all(lp <= 0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m)
    assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if not m)
    assert agent_tokenizer.decode(s.prompt_ids).count("What is 6*7?") == 1  # MILES_PROMPT reached the program
    # The reward is the program's: its last stdout line.
    assert s.reward == float(len(s.response_text) % 2)
    assert take_metrics() == {"rollout/harness_episodes": 1.0, "rollout/harness_failures": 0.0,
                              "rollout/harness_timeouts": 0.0, "rollout/harness_truncated": 0.0}


def test_concurrent_episodes_each_get_their_own_session(agent_engine_url, agent_tokenizer, agent_script):
    h = HarnessConfig(command=f"{sys.executable} {agent_script}")

    async def many():
        fn = get_generate_fn("harness")
        agent = AgentConfig(harness=h, max_response_tokens=64)
        async with httpx.AsyncClient(timeout=60) as client:
            ctx = GenerateContext(client, agent_engine_url, agent_tokenizer, None, lambda r, l: 0.0, agent)
            return await asyncio.gather(*(fn(ctx, Prompt(index=i, text=f"q{i}", label="1"),
                                             SamplingParams(temperature=1.0, seed=i), f"p{i}-0-{time.monotonic_ns()}")
                                          for i in range(4)))

    samples = asyncio.run(many())
    assert [len(s.weight_versions) for s in samples] == [2, 2, 2, 2]
    assert [agent_tokenizer.decode(s.prompt_ids).count(f"q{i}") for i, s in enumerate(samples)] == [1, 1, 1, 1]


def test_crash_timeout_and_missing_reward_are_counted_and_handled_like_reward_errors(
        agent_engine_url, agent_tokenizer, tmp_path):
    take_metrics()
    crash = tmp_path / "crash.py"
    crash.write_text("import openai, os\nopenai.OpenAI(max_retries=0).chat.completions.create(model='m', "
                     "messages=[{'role': 'user', 'content': 'x'}], max_tokens=2)\nraise SystemExit(3)\n")
    s = run(agent_engine_url, agent_tokenizer, HarnessConfig(command=f"{sys.executable} {crash}", fallback_score=-1))
    assert s.reward == -1.0 and s.status is not SampleStatus.ABORTED  # on_failure = score: trained with the fallback
    assert s.metadata["harness_failure"].startswith("exit: ") and "status 3" in s.metadata["harness_failure"]
    s = run(agent_engine_url, agent_tokenizer, HarnessConfig(command=f"{sys.executable} {crash}",
                                                             on_failure="drop_group"))
    assert s.status is SampleStatus.ABORTED  # its group goes to buffer.on_failure

    # A program that outlives its timeout is killed with its background children.
    pidfile = tmp_path / "child.pid"
    hang = tmp_path / "hang.py"
    hang.write_text(f"import subprocess, time\np = subprocess.Popen(['sleep', '300'])\n"
                    f"open({str(pidfile)!r}, 'w').write(str(p.pid))\ntime.sleep(300)\n")
    t0 = time.monotonic()
    s = run(agent_engine_url, agent_tokenizer, HarnessConfig(command=f"{sys.executable} {hang}"), timeout_s=3)
    assert time.monotonic() - t0 < 30
    assert s.status is SampleStatus.ABORTED and s.metadata["harness_failure"].startswith("timeout")  # never spoke
    child = int(pidfile.read_text())
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"

    silent = tmp_path / "silent.py"
    silent.write_text("import openai\nopenai.OpenAI(max_retries=0).chat.completions.create(model='m', "
                      "messages=[{'role': 'user', 'content': 'x'}], max_tokens=2)\nprint('done, no reward')\n")
    s = run(agent_engine_url, agent_tokenizer, HarnessConfig(command=f"{sys.executable} {silent}"))
    assert s.metadata["harness_failure"].startswith("no_reward: the last line")
    assert take_metrics() == {"rollout/harness_episodes": 4.0, "rollout/harness_failures": 4.0,
                              "rollout/harness_timeouts": 1.0, "rollout/harness_truncated": 0.0}


def test_the_run_reward_and_the_session_budget(agent_engine_url, agent_tokenizer, tmp_path):
    loop = tmp_path / "loop.py"
    loop.write_text(textwrap.dedent('''
        import openai
        client, messages = openai.OpenAI(max_retries=0), [{"role": "user", "content": "talk"}]
        try:
            while True:
                r = client.chat.completions.create(model="m", messages=messages, max_tokens=3)
                messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        except openai.BadRequestError as e:
            assert "budget is spent" in str(e), e
            raise SystemExit(1)
    '''))
    seen = []
    s = run(agent_engine_url, agent_tokenizer, HarnessConfig(command=f"{sys.executable} {loop}", reward="run"),
            max_turns=3, reward_fn=lambda response, label: seen.append((response, label)) or 0.5)
    assert len(s.weight_versions) == 3 and s.status is SampleStatus.TRUNCATED
    assert "harness_failure" not in s.metadata  # giving up when the budget ran out is not a crash
    assert s.reward == 0.5 and seen == [(s.response_text, "42")]


async def scripted_agent(episode):
    """A harness given as module:function."""
    import openai

    client = openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": episode.prompt}],
                                         max_tokens=3)
    return {"reward": 0.25}


def test_a_function_harness(agent_engine_url, agent_tokenizer):
    s = run(agent_engine_url, agent_tokenizer, HarnessConfig(function=f"{__name__}:scripted_agent"))
    assert s.reward == 0.25 and len(s.weight_versions) == 1


@pytest.mark.parametrize("over,match", [
    ({"rollout.generate_fn": "harness"}, "set exactly one of command"),
    ({"rollout.generate_fn": "harness", "rollout.agent.harness.function": "nowhere:fn"}, "harness.function"),
    ({"rollout.agent.harness.command": "python a.py"}, "set rollout.generate_fn = \"harness\""),
    ({"rollout.generate_fn": "harness", "rollout.agent.harness.command": "x",
      "rollout.agent.harness.tool_parser": "nope"}, "tool_parser: unknown tool-call parser 'nope'"),
])
def test_harness_settings_are_checked_when_the_run_is_configured(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(RunConfig, None, {"model.path": "unused", **over})


def test_the_example_agent_calls_its_tool_and_scores_its_answer(agent_model_dir, tmp_path):
    """examples/harness/agent.py against a scripted model that calls the calculator, then answers."""
    from miles.models.loading import load_tokenizer
    from tests.helpers.chat_templates import QWEN3_STYLE, tokenizer_with_template
    from tests.helpers.scripted_engine import ScriptedEngine

    tok = load_tokenizer(tokenizer_with_template(agent_model_dir, QWEN3_STYLE, tmp_path))
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    engine = ScriptedEngine()
    try:
        engine.replies += [
            tok('<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>',
                add_special_tokens=False).input_ids + end,
            tok("42", add_special_tokens=False).input_ids + end]
        s = run(engine.url, tok, HarnessConfig(command=f"{sys.executable} examples/harness/agent.py"),
                max_response_tokens=256)
    finally:
        engine.stop()
    assert s.reward == 1.0 and len(s.weight_versions) == 2, s.metadata
    tool_turn = [t for t, m in zip(s.response_ids, s.loss_mask) if m == 0]
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(tool_turn)  # the agent ran its calculator
    assert "calc" in tok.decode(s.prompt_ids)  # its tool schema reached the prompt
    # The agent streams its replies, so the session had the engine stream every turn.
    assert [r.get("stream") for r in engine.requests] == [True, True]


def test_the_example_run_config_loads():
    cfg = load_config(RunConfig, "examples/harness/grpo.toml", {"model.path": "unused"})
    assert cfg.rollout.generate_fn == "harness" and cfg.rollout.agent.harness.function == "examples.harness.agent:episode"
    # Room for a whole calc call (67 tokens of the example's tokenizer) and its turn end, in rollouts and evals:
    # a call cut off before its closing tag is no call, and the episode scores 0.
    assert cfg.rollout.task.fixed_width and cfg.rollout.max_new_tokens >= 68 and cfg.eval.max_new_tokens >= 68
    assert os.path.isabs(cfg.rollout.agent.harness.cwd)  # fixed where the run was configured
