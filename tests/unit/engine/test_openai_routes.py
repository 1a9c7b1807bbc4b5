"""The built-in engine's OpenAI-compatible routes, driven by the `openai` client as users drive SGLang's:
/v1/models lists the served model, and a chat completion is /generate on the chat-templated prompt."""

from __future__ import annotations

import re

import httpx
import pytest

MESSAGES = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture
def openai_client(engine_url):
    from openai import OpenAI

    with OpenAI(base_url=f"{engine_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _templated_generate(engine_url, tokenizer, messages, **params) -> dict:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    r = httpx.post(f"{engine_url}/generate", json={"input_ids": list(ids), "sampling_params": params}, timeout=120)
    assert r.status_code == 200, r.text
    return {**r.json(), "prompt_tokens": len(ids)}


def test_v1_models_lists_the_served_model(openai_client, model_dir):
    (card,) = openai_client.models.list().data
    assert card.id == model_dir and card.object == "model"
    assert card.max_model_len == 512  # SGLang's card carries the context length
    assert openai_client.models.retrieve(model_dir).id == model_dir
    from openai import NotFoundError

    with pytest.raises(NotFoundError, match="not served here"):
        openai_client.models.retrieve("some/other-model")


def test_a_chat_completion_is_generate_on_the_chat_templated_prompt(openai_client, engine_url, tokenizer, model_dir):
    reply = openai_client.chat.completions.create(model=model_dir, messages=MESSAGES, temperature=0, max_tokens=12)
    expected = _templated_generate(engine_url, tokenizer, MESSAGES, temperature=0, max_new_tokens=12)
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == expected["text"]
    assert choice.finish_reason == expected["meta_info"]["finish_reason"]["type"]
    assert reply.usage.prompt_tokens == expected["prompt_tokens"]
    assert reply.usage.completion_tokens == len(expected["output_ids"])
    assert reply.object == "chat.completion" and reply.model == model_dir and reply.id.startswith("chatcmpl-")

    # Streamed, the same turn arrives as chunks that add up to the same text.
    stream = openai_client.chat.completions.create(model=model_dir, messages=MESSAGES, temperature=0, max_tokens=12,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert chunks[-1].usage.completion_tokens == len(expected["output_ids"])

    # Stop strings are the engine's own: the text ends before the first one, as /generate's does.
    stop = re.search(r"[A-Za-z0-9]{2}", expected["text"][2:]).group(0)
    stopped = openai_client.chat.completions.create(model=model_dir, messages=MESSAGES, temperature=0,
                                                    max_tokens=12, stop=[stop])
    cut = _templated_generate(engine_url, tokenizer, MESSAGES, temperature=0, max_new_tokens=12, stop=[stop])
    assert stopped.choices[0].message.content == cut["text"] and len(cut["text"]) < len(expected["text"])


@pytest.mark.parametrize("body,field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": MESSAGES, "temperature": 3}, "temperature"),
    ({"messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),
    ({"messages": MESSAGES, "stop": ["x"] * 65}, "stop"),
    ({"messages": MESSAGES, "n": 2}, "n"),
    ({"messages": MESSAGES, "logprobs": True}, "logprobs"),
    ({"messages": MESSAGES, "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": MESSAGES, "seed": -1}, "seed"),
])
def test_a_bad_chat_request_gets_400_naming_the_field(engine_url, body, field):
    r = httpx.post(f"{engine_url}/v1/chat/completions", json={"max_tokens": 2, **body} if "max_tokens" not in body
                   else body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()  # SGLang's error object
    assert err["object"] == "error" and err["code"] == 400 and err["message"].startswith(field), err
