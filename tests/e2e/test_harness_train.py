"""`miles train` trains a black-box harness: a program written by the test against the `openai`
client (with a tool) runs once per sample against a session of the run; Ray, engine process, FSDP2
trainer and weight sync are all real."""

import json
import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e

AGENT = textwrap.dedent('''
    import json, os
    import openai

    client = openai.OpenAI(max_retries=0)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": os.environ["MILES_PROMPT"]}]
    reply = client.chat.completions.create(model="miles", messages=messages, tools=tools).choices[0].message
    messages += [reply.model_dump(exclude_none=True), {"role": "tool", "content": "7"}]
    final = client.chat.completions.create(model="miles", messages=messages, tools=tools).choices[0].message
    # A toy reward that varies between samples, so groups carry a learning signal.
    print(json.dumps({"reward": float(len(final.content or "") % 2)}))
''')


def test_miles_train_runs_a_harness_program_for_two_steps(tiny_model_dir, tmp_path, ray_cluster):
    from miles.cli import main

    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    config = tmp_path / "run.toml"
    config.write_text(textwrap.dedent(f'''
        [run]
        name = "harness"
        output_dir = "{tmp_path}"
        [model]
        path = "{tiny_model_dir}"
        [loop]
        num_steps = 2
        [eval]
        every_steps = 0
        num_prompts = 2
        [buffer]
        filter = "none"
        [rollout]
        prompts_per_step = 2
        n_samples_per_prompt = 2
        max_new_tokens = 6
        generate_fn = "harness"
        [rollout.agent]
        max_turns = 2
        max_response_tokens = 40
        episode_timeout_s = 40
        [rollout.agent.harness]
        command = "{sys.executable} {agent}"
        [sync]
        bucket_size_mb = 1
    '''))
    assert main(["train", str(config)]) == 0
    records = [json.loads(line) for line in (tmp_path / "harness" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/harness_episodes" in r]
    assert sum(r["rollout/harness_episodes"] for r in steps) >= 8  # 2 steps x 2 prompts x 2 samples
    assert sum(r["rollout/harness_failures"] for r in steps) == 0
    # Two model turns of at most 6 tokens each plus the rendered tool turn: the session's tokens were trained.
    assert all(6 < r["rollout/response_len_mean"] <= 40 for r in steps)
    assert records[-1]["rollout/weight_version"] == 1  # step 2 generated under the weights pushed after step 1
