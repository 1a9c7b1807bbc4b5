"""Chat templates: a prompt becomes token ids once, through the tokenizer's template when it is a
list of messages (or when rollout.task.apply_chat_template wraps text as a user turn).

An optional system prompt goes first (unless the messages bring their own), and template kwargs
(enable_thinking, ...) pass through to `apply_chat_template(add_generation_prompt=True)`.
Non-goal: multi-turn episodes after the first prompt (rollout/chat_format.py).
"""

from __future__ import annotations


def chat_messages(task_cfg, text: str, messages: list[dict] | None) -> list[dict] | None:
    """The messages the template renders, or None for a prompt sent as plain text."""
    if messages is None and not task_cfg.apply_chat_template:
        return None
    out = list(messages) if messages else [{"role": "user", "content": text}]
    if task_cfg.system_prompt and out[0]["role"] != "system":
        out = [{"role": "system", "content": task_cfg.system_prompt}] + out
    return out


def encode_prompt(tokenizer, task_cfg, text: str, messages: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt: its text, or its messages through the chat template."""
    chat = chat_messages(task_cfg, text, messages)
    if chat is None:
        return tokenizer(text, add_special_tokens=False).input_ids
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')} has no chat template, but the "
                         "prompt is a list of messages (or rollout.task.apply_chat_template is on): use a model "
                         "whose tokenizer_config.json has a chat_template, or give plain-text prompts")
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                             **task_cfg.chat_template_kwargs)
    return tokenizer(rendered, add_special_tokens=False).input_ids
