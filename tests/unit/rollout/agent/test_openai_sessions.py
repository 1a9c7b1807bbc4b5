"""The OpenAI-compatible session endpoint, driven by the real `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest

from miles.data.chat import ChatFormat
from miles.rollout.sessions.server import start_session_server


@pytest.fixture(scope="module")
def sessions(agent_engine_url, agent_model_dir):
    server = start_session_server(agent_engine_url, agent_model_dir)
    yield server
    server.stop()


def harness(base_url: str) -> list[str]:
    """A black-box agent: chats, feeds back a tool result, asks again."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "You are a calculator agent."},
                {"role": "user", "content": "What is 12+30?"}]
    replies = []
    for observation in ("lower 42", "done?"):
        r = client.chat.completions.create(model="miles", messages=messages, max_tokens=10, temperature=1.0, seed=5)
        reply = r.choices[0].message.content
        replies.append(reply)
        messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": observation}]
    r = client.chat.completions.create(model="miles", messages=messages, max_tokens=10, temperature=1.0, seed=6)
    replies.append(r.choices[0].message.content)
    return replies


def test_openai_client_drives_a_session_and_miles_records_exact_tokens(sessions, agent_tokenizer):
    tok = agent_tokenizer
    fmt = ChatFormat(tok)
    sid = httpx.post(f"{sessions.url}/sessions", json={"session_id": "episode-1"}).json()["session_id"]
    replies = harness(sessions.base_url(sid))
    traj = httpx.get(f"{sessions.url}/sessions/{sid}/trajectory").json()
    # The chat template was applied once, to the first request's messages.
    assert traj["prompt_ids"] == tok(tok.apply_chat_template(
        [{"role": "system", "content": "You are a calculator agent."}, {"role": "user", "content": "What is 12+30?"}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
    ids, mask = traj["response_ids"], traj["loss_mask"]
    assert len(ids) == len(mask) == len(traj["rollout_logprobs"]) and len(traj["weight_versions"]) == 3
    # Split the trajectory into model runs (mask 1) and environment runs (mask 0).
    runs, cur = [], [mask[0], []]
    for t, m in zip(ids, mask):
        if m != cur[0]:
            runs.append(cur)
            cur = [m, []]
        cur[1].append(t)
    runs.append(cur)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
    model_runs = [r for m, r in runs if m == 1]
    for reply, run in zip(replies, model_runs):
        assert reply == tok.decode([t for t in run if t != fmt.end_id], skip_special_tokens=True)
    # Later turns tokenize only the appended suffix, exactly as ChatFormat renders a tool turn.
    for (m, obs_run), text, prev in zip([r for r in runs if r[0] == 0], ("lower 42", "done?"), model_runs):
        assert obs_run == fmt.observation_ids(text, closed=prev[-1] == fmt.end_id)
    # Model-token logprobs are the engine's (negative), environment tokens carry the 0.0 placeholder.
    assert all(lp <= 0 for lp, m in zip(traj["rollout_logprobs"], mask) if m)
    assert all(lp == 0.0 for lp, m in zip(traj["rollout_logprobs"], mask) if not m)
    sample = sessions.store.get(sid).to_sample(reward=1.0)
    assert sample.response_ids == ids and sample.loss_mask[-1] == 1


def test_a_streamed_multi_turn_session_on_a_real_engine_records_the_engines_output_ids(sessions, agent_engine_url,
                                                                                     agent_tokenizer):
    """The openai client streams every turn (tools offered, tool results sent back); the engine
    streams its tokens to the session, which forwards them as they come. Each recorded model turn is
    exactly what the engine outputs for that turn's input ids (replayed unstreamed, greedily)."""
    tok = agent_tokenizer
    sid = sessions.new_session().id
    client = openai.OpenAI(base_url=sessions.base_url(sid), api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "What is 12+30?"}]
    streamed = []
    for observation in ("42", "ok", None):
        chunks = list(client.chat.completions.create(model="miles", messages=messages, tools=tools, max_tokens=12,
                                                     temperature=0, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert len([c for c in chunks if c.choices[0].delta.content]) > 1  # token by token, not one piece
        streamed.append(content)
        if observation is not None:
            messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": observation}]
    traj = httpx.get(f"{sessions.url}/sessions/{sid}/trajectory").json()
    ids, mask = traj["prompt_ids"] + traj["response_ids"], [0] * len(traj["prompt_ids"]) + traj["loss_mask"]
    starts = [i for i in range(len(ids)) if mask[i] and not mask[i - 1]]
    ends = [next((j for j in range(i, len(ids)) if not mask[j]), len(ids)) for i in starts]
    assert len(starts) == 3
    for i, j, content in zip(starts, ends, streamed):
        engine = httpx.post(f"{agent_engine_url}/generate", timeout=120, json={
            "input_ids": ids[:i], "sampling_params": {"temperature": 0, "max_new_tokens": 12,
                                                      "stop_token_ids": [tok.convert_tokens_to_ids("<|im_end|>")]}})
        assert ids[i:j] == engine.json()["output_ids"]
        assert content == tok.decode([t for t in ids[i:j] if t != tok.convert_tokens_to_ids("<|im_end|>")],
                                     skip_special_tokens=True)


def test_rewriting_history_is_refused_with_a_reason(sessions):
    sid = sessions.new_session().id
    client = openai.OpenAI(base_url=sessions.base_url(sid), api_key="unused", max_retries=0)
    first = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="miles", messages=first, max_tokens=4).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="sent back unchanged"):
        client.chat.completions.create(model="miles", max_tokens=4, messages=[
            {"role": "user", "content": "hello"}, {"role": "assistant", "content": reply},
            {"role": "tool", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="assistant turns come from the model"):
        client.chat.completions.create(model="miles", max_tokens=4, messages=first + [
            {"role": "assistant", "content": reply}, {"role": "assistant", "content": "forged"}])
    with pytest.raises(openai.BadRequestError, match=r"^Error code: 400 - n: .*start one session per sample"):
        client.chat.completions.create(model="miles", messages=first, n=2)
    with pytest.raises(openai.BadRequestError, match="image parts are not supported by the session server"):
        client.chat.completions.create(model="miles", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "hi"}]}])
    # The refused calls left the session untouched: the honest continuation still works.
    ok = client.chat.completions.create(model="miles", max_tokens=4, messages=first + [
        {"role": "assistant", "content": reply}, {"role": "tool", "content": "x"}])
    assert ok.choices[0].message.role == "assistant"
    gone = openai.OpenAI(base_url=sessions.base_url("missing"), api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="POST /sessions"):
        gone.chat.completions.create(model="miles", messages=first)


def test_miles_sessions_command_serves_sessions_an_openai_client_can_drive(agent_engine_url, agent_model_dir):
    """`miles sessions` is how a user reaches the session API: a harness drives it, the tokens come back."""
    import signal
    import subprocess
    import sys

    # As from a terminal, where Ctrl-C reaches the process: a shell's background job (a suite started
    # with `&`) inherits SIGINT ignored, and so would this child.
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "sessions", "--engine-url", agent_engine_url,
                             "--tokenizer", agent_model_dir, "--max-tokens", "6"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        assert line.startswith("miles sessions at http://127.0.0.1:"), line
        url = line.split()[3].rstrip(":")
        created = httpx.post(f"{url}/sessions", json={"session_id": "cli-1"}, timeout=30).json()
        client = openai.OpenAI(base_url=created["base_url"], api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="miles", messages=[{"role": "user", "content": "2+2?"}],
                                               temperature=1.0, seed=1)
        traj = httpx.get(f"{url}/sessions/cli-1/trajectory", timeout=30).json()
        assert 1 <= sum(traj["loss_mask"]) <= 6  # --max-tokens applied to a request that gave none
        assert reply.choices[0].message.content is not None and traj["weight_versions"]
        client.close()
    finally:
        proc.send_signal(signal.SIGINT)
        # communicate() drains the child's output while it shuts down, so a full pipe cannot stall it.
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
