"""Tools through the session endpoint, driven by the real `openai` client, with a Qwen3-style chat
template (tools in the system block, tool results as <tool_response>, earlier <think> blocks dropped
on re-render). The engine is a scripted /generate (tests/helpers/scripted_engine.py) so the model
"writes" tool calls and reasoning; its ids are given in a non-canonical tokenization (one token per
character) so any decode -> re-encode along the way would show up as different ids."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from miles.models.loading import load_tokenizer
from miles.rollout.sessions.server import start_session_server
from miles.rollout.sessions.store import SessionLimits
from tests.helpers.chat_templates import LLAMA3_STYLE, LLAMA3_TOKENS, QWEN3_STYLE, tokenizer_with_template
from tests.helpers.scripted_engine import ScriptedEngine

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def qwen3_dir(agent_model_dir, tmp_path_factory):
    return tokenizer_with_template(agent_model_dir, QWEN3_STYLE, tmp_path_factory.mktemp("qwen3-style"))


@pytest.fixture(scope="module")
def tok(qwen3_dir):
    return load_tokenizer(qwen3_dir)


@pytest.fixture(scope="module")
def engine():
    e = ScriptedEngine()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def server(engine, qwen3_dir):
    s = start_session_server(engine.url, qwen3_dir)
    yield s
    s.stop()


def by_char(tok, text: str, end: str = "<|im_end|>") -> list[int]:
    """`text` as one token per character (+ the turn end): valid ids the tokenizer itself would merge."""
    return [i for ch in text for i in tok(ch, add_special_tokens=False).input_ids] + [tok.convert_tokens_to_ids(end)]


def client_for(server, sid, api_key="unused"):
    return openai.OpenAI(base_url=server.base_url(sid), api_key=api_key, max_retries=0)


def test_tool_call_round_trip_streamed_with_exact_tokens(server, engine, tok):
    sid = server.new_session().id
    client = client_for(server, sid)
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call>'
    answer = "The answer is 36."
    engine.replies += [by_char(tok, call_text), by_char(tok, answer)]
    n0 = len(engine.requests)
    messages = [{"role": "system", "content": "You are a calculator agent."},
                {"role": "user", "content": "What is 12*3?"}]
    r = client.chat.completions.create(model="miles", messages=messages, tools=[CALC], tool_choice="auto")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12*3"}
    # The template listed the tool for the model: its schema is in the prompt the engine got.
    prompt_text = tok.decode(engine.requests[n0]["input_ids"])
    assert "<tools>" in prompt_text and '"expression"' in prompt_text

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "36"}]
    stream = client.chat.completions.create(model="miles", messages=messages, tools=[CALC], stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == answer and finish == ["stop"]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed in pieces
    assert chunks[-1].usage.completion_tokens == len(engine.replied[-1])

    traj = httpx.get(f"{server.url}/sessions/{sid}/trajectory").json()
    reply1, reply2 = engine.replied[n0], engine.replied[n0 + 1]
    suffix = traj["response_ids"][len(reply1):len(traj["response_ids"]) - len(reply2)]
    # The tool result went through the template (as Qwen3 renders it), and only it was tokenized.
    assert tok.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n" \
                                 "<|im_start|>assistant\n"
    assert traj["response_ids"] == reply1 + suffix + reply2
    assert traj["loss_mask"] == [1] * len(reply1) + [0] * len(suffix) + [1] * len(reply2)
    # Exactly what the engine saw on the second turn, and the model's ids as it produced them: a
    # re-encoding of the decoded reply would have merged characters into other tokens.
    assert engine.requests[n0 + 1]["input_ids"] == traj["prompt_ids"] + reply1 + suffix
    assert tok(tok.decode(reply1[:-1]), add_special_tokens=False).input_ids != reply1[:-1]


def test_streamed_parallel_tool_calls_and_tool_choice_none(server, engine, tok):
    two = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>\n'
           '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>')
    engine.replies += [by_char(tok, two), by_char(tok, two)]
    client = client_for(server, server.new_session().id)
    chunks = list(client.chat.completions.create(model="miles", messages=[{"role": "user", "content": "go"}],
                                                 tools=[CALC], stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0, 1]
    assert [json.loads(d.function.arguments)["expression"] for d in deltas] == ["1+1", "2+2"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice = "none": the text is returned as written, nothing is parsed.
    r = client_for(server, server.new_session().id).chat.completions.create(
        model="miles", messages=[{"role": "user", "content": "go"}], tools=[CALC], tool_choice="none")
    assert r.choices[0].message.content == two and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_history_rewriting_template_cannot_make_recorded_tokens_drift(server, engine, tok):
    """Qwen3 drops an earlier turn's <think> block when the conversation is re-rendered after a new
    user message. The session never re-renders: it appends the new turn's tokens after the engine's
    own ids, so the trajectory keeps the reasoning tokens the model generated and trained on."""
    sid = server.new_session().id
    client = client_for(server, sid)
    first = "<think>\nadd two and two\n</think>\n\n4"
    engine.replies += [by_char(tok, first), by_char(tok, "<think>\nsix\n</think>\n\n6")]
    n0 = len(engine.requests)
    messages = [{"role": "user", "content": "2+2?"}]
    r = client.chat.completions.create(model="miles", messages=messages)
    assert r.choices[0].message.content == first
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "3+3?"}]
    client.chat.completions.create(model="miles", messages=messages)
    traj = httpx.get(f"{server.url}/sessions/{sid}/trajectory").json()
    reply1, reply2 = engine.replied[n0], engine.replied[n0 + 1]
    seen = engine.requests[n0 + 1]["input_ids"]
    # Turn by turn: the engine's input is the trajectory so far, the trajectory's model runs are its outputs.
    assert seen[:len(traj["prompt_ids"]) + len(reply1)] == traj["prompt_ids"] + reply1
    assert traj["prompt_ids"] + traj["response_ids"] == seen + reply2
    assert "add two and two" in tok.decode(seen)
    # What re-rendering the conversation would have given: the template dropped the reasoning.
    rerendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "add two and two" not in rerendered
    assert tok(rerendered, add_special_tokens=False).input_ids != seen


@pytest.mark.parametrize("body,field", [
    ({}, "messages: Field required"),
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools.0.function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [CALC],
      "tool_choice": {"type": "function", "function": {"name": "shell"}}}, "tool_choice names function 'shell'"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "needs a non-empty tools"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature:"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens:"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, "n: "),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs:"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]}, "arguments must be"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_requests_get_400_naming_the_field(server, body, field):
    sid = server.new_session().id
    r = httpx.post(f"{server.url}/sessions/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_changed_tools_and_a_template_refusal_are_400s_and_leave_the_session_usable(server, engine, tok):
    sid = server.new_session().id
    client = client_for(server, sid)
    # The Qwen3-style template raises on a conversation without a user query: a 400 that says so.
    with pytest.raises(openai.BadRequestError, match="chat template refused them: No user query"):
        client.chat.completions.create(model="miles", messages=[{"role": "system", "content": "x"}])
    engine.replies += [by_char(tok, "hi"), by_char(tok, "ok")]
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="miles", messages=msgs, tools=[CALC])
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
    with pytest.raises(openai.BadRequestError, match="tools: send the same tools"):
        client.chat.completions.create(model="miles", messages=msgs)
    assert client.chat.completions.create(model="miles", messages=msgs, tools=[CALC]).choices[0].message.content == "ok"


def test_session_with_a_key_refuses_other_callers_and_spends_its_budget(server, engine, tok):
    sid = server.new_session(api_key="k-123", limits=SessionLimits(max_turns=1, sampling={"temperature": 0.7})).id
    with pytest.raises(openai.AuthenticationError, match="needs its API key"):
        client_for(server, sid, api_key="wrong").chat.completions.create(
            model="miles", messages=[{"role": "user", "content": "x"}])
    engine.replies.append(by_char(tok, "a"))
    client = client_for(server, sid, api_key="k-123")
    r = client.chat.completions.create(model="miles", messages=[{"role": "user", "content": "x"}], temperature=1.5)
    assert engine.requests[-1]["sampling_params"]["temperature"] == 0.7  # the run's, not the caller's
    with pytest.raises(openai.BadRequestError, match="budget is spent .max_turns = 1"):
        client.chat.completions.create(model="miles", messages=[
            {"role": "user", "content": "x"}, {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "again"}])
    assert server.store.get(sid).to_sample().status.value == "truncated"


def test_llama3_style_template_tool_calls_and_trimmed_history_stay_token_exact(agent_model_dir, tmp_path):
    """A second family: turns closed by <|eot_id|> with nothing after it, a system header always
    there, tool results as `ipython` turns, bare-JSON calls (the llama3_json parser), and contents
    trimmed on every render, so a reply with surrounding spaces is rewritten when re-rendered."""
    d = tokenizer_with_template(agent_model_dir, LLAMA3_STYLE, tmp_path, LLAMA3_TOKENS)
    tok = load_tokenizer(d)
    engine = ScriptedEngine()
    server = start_session_server(engine.url, d, turn_end_token="<|eot_id|>", tool_parser="llama3_json")
    try:
        sid = server.new_session().id
        client = client_for(server, sid)
        engine.replies += [by_char(tok, '{"name": "calculator", "parameters": {"expression": "2+2"}}', "<|eot_id|>"),
                           by_char(tok, "  four  ", "<|eot_id|>"), by_char(tok, "ok", "<|eot_id|>")]
        messages = [{"role": "user", "content": "2+2?"}]
        r = client.chat.completions.create(model="miles", messages=messages, tools=[CALC]).choices[0]
        assert r.finish_reason == "tool_calls" and r.message.tool_calls[0].function.name == "calculator"
        messages += [r.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": r.message.tool_calls[0].id, "content": "4"}]
        r = client.chat.completions.create(model="miles", messages=messages, tools=[CALC]).choices[0]
        assert r.message.content == "  four  " and not r.message.tool_calls
        messages += [{"role": "assistant", "content": r.message.content}, {"role": "user", "content": "thanks"}]
        client.chat.completions.create(model="miles", messages=messages, tools=[CALC])
        traj = httpx.get(f"{server.url}/sessions/{sid}/trajectory").json()
        r1, r2, r3 = engine.replied
        ids = traj["response_ids"]
        s1 = ids[len(r1):ids.index(r2[0], len(r1))]
        assert tok.decode(s1) == "<|start_header_id|>ipython<|end_header_id|>\n\n4<|eot_id|>" \
                                 "<|start_header_id|>assistant<|end_header_id|>\n\n"
        s2 = ids[len(r1) + len(s1) + len(r2):len(ids) - len(r3)]
        assert tok.decode(s2) == "<|start_header_id|>user<|end_header_id|>\n\nthanks<|eot_id|>" \
                                 "<|start_header_id|>assistant<|end_header_id|>\n\n"
        assert ids == r1 + s1 + r2 + s2 + r3
        for req in engine.requests:  # the engine's input, turn by turn, is the trajectory so far
            assert traj["prompt_ids"] + ids[:len(req["input_ids"]) - len(traj["prompt_ids"])] == req["input_ids"]
        rerendered = tok.apply_chat_template(messages, tools=[CALC], add_generation_prompt=True, tokenize=False)
        assert "  four  " not in rerendered and "  four  " in tok.decode(engine.requests[2]["input_ids"])
    finally:
        server.stop()
        engine.stop()


def test_a_closed_session_records_nothing_more(server, engine, tok):
    """A training run closes an episode's session when its program is done or killed; a reply that
    arrives afterwards is refused (409) and the recorded tokens stay as they were."""
    session = server.new_session()
    session.close()
    engine.replies.append(by_char(tok, "late"))
    with pytest.raises(openai.ConflictError, match="episode is over"):
        client_for(server, session.id).chat.completions.create(model="miles",
                                                               messages=[{"role": "user", "content": "x"}])
    assert session.prompt_ids == [] and session.response_ids == [] and session.weight_versions == []


def test_responses_api_tool_round_trip_by_previous_response_id_and_by_full_input(server, engine, tok):
    """/v1/responses through the `openai` client: function_call output items, function_call_output
    input items, continuing from previous_response_id or by sending the whole history back; the
    recorded tokens are the same as through chat completions."""
    call_text = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*3"}}</tool_call>'
    tools = [{"type": "function", **CALC["function"]}]
    for by_id in (True, False):
        sid = server.new_session().id
        client = client_for(server, sid)
        engine.replies += [by_char(tok, call_text), by_char(tok, "36")]
        n0 = len(engine.requests)
        first = [{"role": "user", "content": "What is 12*3?"}]
        r = client.responses.create(model="miles", instructions="You are a calculator agent.", input=first,
                                    tools=tools)
        (call,) = r.output
        assert call.type == "function_call" and call.name == "calculator"
        assert json.loads(call.arguments) == {"expression": "12*3"} and r.status == "completed"
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "36"}
        if by_id:
            r2 = client.responses.create(model="miles", previous_response_id=r.id, input=[result], tools=tools)
        else:
            r2 = client.responses.create(model="miles", instructions="You are a calculator agent.", tools=tools,
                                         input=first + [call.model_dump(exclude_none=True), result])
        assert r2.output_text == "36" and r2.usage.output_tokens == len(engine.replied[-1])
        traj = httpx.get(f"{server.url}/sessions/{sid}/trajectory").json()
        reply1, reply2 = engine.replied[n0], engine.replied[n0 + 1]
        suffix = traj["response_ids"][len(reply1):len(traj["response_ids"]) - len(reply2)]
        assert tok.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n" \
                                     "<|im_start|>assistant\n"
        assert engine.requests[n0 + 1]["input_ids"] == traj["prompt_ids"] + reply1 + suffix
        assert "You are a calculator agent." in tok.decode(traj["prompt_ids"])
    with pytest.raises(openai.BadRequestError, match="previous_response_id: 'resp_nope'"):
        client.responses.create(model="miles", previous_response_id="resp_nope", input="more")
    r = httpx.post(f"{server.url}/sessions/{sid}/v1/responses", json={"input": "x", "stream": True})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("stream: ")


def test_a_streamed_turn_reaches_the_client_while_the_engine_still_generates_it(server, engine, tok):
    """Content goes out token by token and a tool call as soon as its block closes, while the engine
    is still generating the rest of the turn; the recorded tokens are the engine's whole turn."""
    first = 'Checking.<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    reply = first + '\n<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    held = len(by_char(tok, first)) - 1  # the engine stops after the first call's closing tag
    engine.replies.append(by_char(tok, reply))
    engine.hold_after, n0 = held, len(engine.streamed_to)
    engine.release.clear()
    sid = server.new_session().id
    try:
        stream = client_for(server, sid).chat.completions.create(
            model="miles", messages=[{"role": "user", "content": "6*7 and 1+1?"}], tools=[CALC], stream=True)
        content, calls = "", []
        for chunk in stream:
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
            if calls:
                break
        # The client holds the first call and the text before it; the engine has not sent one more token.
        assert content == "Checking." and json.loads(calls[0].function.arguments) == {"expression": "6*7"}
        assert engine.streamed_to[n0] == held
        engine.release.set()
        rest = list(stream)
    finally:
        engine.hold_after = None
        engine.release.set()
    calls += [tc for c in rest for tc in (c.choices[0].delta.tool_calls or [])]
    assert "".join(c.choices[0].delta.content or "" for c in rest) == ""
    assert [(c.index, json.loads(c.function.arguments)["expression"]) for c in calls] == [(0, "6*7"), (1, "1+1")]
    assert rest[-1].choices[0].finish_reason == "tool_calls"
    traj = httpx.get(f"{server.url}/sessions/{sid}/trajectory").json()
    assert traj["response_ids"] == engine.replied[-1] and traj["loss_mask"] == [1] * len(engine.replied[-1])


@pytest.mark.parametrize("incremental", [False, True])
def test_streamed_and_unstreamed_multi_turn_sessions_record_the_same_tokens(server, engine, tok, incremental):
    """A tool-calling conversation driven streamed gives the client the same content and calls as
    unstreamed, and the session records the engine's ids either way, whether the engine streams all
    ids so far in each chunk (SGLang's default) or only the new ones (its incremental mode)."""
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call>'
    script = [by_char(tok, "Let me check.\n" + call), by_char(tok, "It is 36.")]
    engine.incremental = incremental
    results = []
    try:
        for streamed in (False, True):
            engine.replies += script
            sid = server.new_session().id
            client = client_for(server, sid)
            messages = [{"role": "user", "content": "What is 12*3?"}]
            seen = []
            for observation in ("36", None):
                kw = {"stream": True} if streamed else {}
                r = client.chat.completions.create(model="miles", messages=messages, tools=[CALC], **kw)
                if streamed:
                    chunks = list(r)
                    content = "".join(c.choices[0].delta.content or "" for c in chunks)
                    calls = [(tc.function.name, tc.function.arguments, tc.id)
                             for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
                    finish = chunks[-1].choices[0].finish_reason
                else:
                    m = r.choices[0].message
                    content, finish = m.content or "", r.choices[0].finish_reason
                    calls = [(tc.function.name, tc.function.arguments, tc.id) for tc in m.tool_calls or []]
                seen.append((content, calls, finish))
                if observation is not None:
                    messages += [{"role": "assistant", "content": content, "tool_calls": [
                        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for n, a, i in calls]},
                                 {"role": "tool", "tool_call_id": calls[0][2], "content": observation}]
            traj = httpx.get(f"{server.url}/sessions/{sid}/trajectory").json()
            model_ids = [t for t, m in zip(traj["response_ids"], traj["loss_mask"]) if m]
            assert model_ids == engine.replied[-2] + engine.replied[-1]
            results.append(([(c, [(n, a) for n, a, _ in k], f) for c, k, f in seen], traj["loss_mask"]))
    finally:
        engine.incremental = False
    assert results[0] == results[1]
    assert results[1][0][0] == ("Let me check.", [("calculator", '{"expression": "12*3"}')], "tool_calls")
    assert results[1][0][1] == ("It is 36.", [], "stop")
