"""Chat templates: a prompt that is a list of messages is rendered once through the tokenizer's own
template (the presets ship one), with the optional system prompt and template kwargs; samples carry
their prompt's metadata."""

from __future__ import annotations

import asyncio
import threading

import httpx

from miles.data.chat import encode_prompt
from miles.models.loading import load_tokenizer
from miles.rewards.runner import RewardRunner
from miles.rollout.config import RolloutConfig
from miles.data.prompts import Prompt, TaskConfig
from miles.engine_api.client import EngineClient
from miles.rollout.group import GroupGenerator

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def test_preset_tokenizer_ships_a_chat_template(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    assert tok.chat_template and "add_generation_prompt" in tok.chat_template


def test_messages_go_through_the_template_with_the_system_prompt(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    ids = encode_prompt(tok, TaskConfig(system_prompt="Answer briefly."), "What is 2+2?", MESSAGES)
    assert tok.decode(ids) == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                               "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    # Plain text stays plain unless apply_chat_template asks for the template.
    assert encode_prompt(tok, TaskConfig(), "2+2=") == tok("2+2=", add_special_tokens=False).input_ids
    wrapped = encode_prompt(tok, TaskConfig(apply_chat_template=True), "2+2=")
    assert tok.decode(wrapped) == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"


def test_template_kwargs_reach_the_template(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = (tok.chat_template + "{% if enable_thinking is defined and not enable_thinking %}"
                         "<think></think>{% endif %}")
    off = encode_prompt(tok, TaskConfig(chat_template_kwargs={"enable_thinking": False}), "x", MESSAGES)
    on = encode_prompt(tok, TaskConfig(), "x", MESSAGES)
    assert tok.decode(off).endswith("<think></think>") and not tok.decode(on).endswith("</think>")


def test_group_samples_carry_the_prompt_metadata_and_templated_ids(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    cfg = RolloutConfig(n_samples_per_prompt=2, task=TaskConfig(system_prompt="S"))
    seen = []

    def engine(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        seen.append(body["input_ids"][0])
        return httpx.Response(200, json=[{"text": "4", "output_ids": [5], "meta_info": {
            "finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.1, 5]], "weight_version": 0}}
            for _ in body["input_ids"]])

    class Buffer:
        weight_version = 0

    g = GroupGenerator(cfg, 0, tok, RewardRunner("exact_match"), None, Buffer(),
                       EngineClient(["http://engine"]), threading.Event())
    prompt = Prompt(3, "What is 2+2?", "4", messages=MESSAGES, metadata={"data_source": "gsm8k"})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
            return await g.generate_group(client, prompt)

    group = asyncio.run(run())
    assert [s.metadata for s in group.samples] == [{"data_source": "gsm8k"}] * 2
    assert [s.reward for s in group.samples] == [1.0, 1.0]
    assert tok.decode(seen[0]).startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 2+2?")


def test_sft_demonstrations_encode_prompts_as_rollouts_do(tiny_model_dir):
    from miles.trainer.sft import demonstration_sequences

    tok = load_tokenizer(tiny_model_dir)
    task = TaskConfig(system_prompt="S")
    prompt = Prompt(0, "What is 2+2?", "4", messages=MESSAGES)
    (seq,) = demonstration_sequences([prompt], tok, lambda p: encode_prompt(tok, task, p.text, p.messages))
    templated = encode_prompt(tok, task, prompt.text, prompt.messages)
    assert seq.tokens[:seq.prompt_len] == templated
    assert seq.tokens[seq.prompt_len:] == tok("4", add_special_tokens=False).input_ids + [tok.eos_token_id]
