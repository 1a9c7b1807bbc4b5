"""Chat templates, in the two ways miles uses them, both through the tokenizer's own template:

- a prompt becomes token ids once (`encode_prompt`), through the template when it is a list of
  messages (or when rollout.task.apply_chat_template wraps text as a user turn); an optional system
  prompt goes first (unless the messages bring their own), and template kwargs (enable_thinking, ...)
  pass through to `apply_chat_template(add_generation_prompt=True)`; the template renders each image
  part as one placeholder, which the model's processor expands to the image's tokens (those ids are
  the ones recorded and trained on);
- a multi-turn conversation grows by appended ids (`ChatFormat`): the token ids of the pieces the
  template puts between turns are cut out of its own rendering, so the history is never re-rendered
  or re-tokenized. The agent episode loop (rollout/agent/episode.py) and the session server
  (rollout/sessions/) use it.

Non-goals: the episode loop itself, chat templates of our own (the tokenizer's is the one the model
was trained with).
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


def encode_prompt(tokenizer, task_cfg, text: str, messages: list[dict] | None = None, images=(),
                  vision=None) -> list[int]:
    """Token ids of a prompt: its text, or its messages through the chat template; with `images`
    (PromptImages), each image placeholder expanded by `vision` (models/vision.VisionProcessor)."""
    if images and vision is None:
        raise ValueError("the prompt has images but the model has no vision tower: use a vision-language "
                         "checkpoint (e.g. `miles init-model --preset tiny-qwen-vl`) or drop the images")
    chat = chat_messages(task_cfg, text, messages)
    if chat is None:
        return tokenizer(text, add_special_tokens=False).input_ids
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')} has no chat template, but the "
                         "prompt is a list of messages (or rollout.task.apply_chat_template is on): use a model "
                         "whose tokenizer_config.json has a chat_template, or give plain-text prompts")
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                             **task_cfg.chat_template_kwargs)
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    if images:
        ids = vision.expand(ids, [vision.process(img.bytes()) for img in images])
    return ids


class ChatFormat:
    """Token ids of chat-template pieces, computed from the tokenizer's own template.

    `suffix_ids(messages, closed)` is what follows a model turn when `messages` (tool results, user
    turns) are appended to the conversation: whatever the template puts after the turn-end token,
    the messages, and the header of the next model turn. It is cut out of a rendering of a fixed
    two-turn stand-in conversation plus `messages`, after the stand-in's last turn-end token, so it
    works for templates that cannot render a tool message on its own (Qwen3 insists on a user
    query first), that open with a system block (Llama 3), or that rewrite earlier turns (Qwen3
    drops old <think> blocks): only the new messages' text is ever tokenized, never the history.
    """

    _STAND_IN = [{"role": "user", "content": "\x00u\x00"}, {"role": "assistant", "content": "\x00a\x00"}]

    def __init__(self, tokenizer, turn_end_token: str = "<|im_end|>", observation_role: str = "tool"):
        self.tokenizer = tokenizer
        self.role = observation_role
        self.turn_end = turn_end_token
        self.end_id = tokenizer.convert_tokens_to_ids(turn_end_token)
        if self.end_id is None or self.end_id == tokenizer.unk_token_id or \
                tokenizer.convert_ids_to_tokens(self.end_id) != turn_end_token:
            raise ValueError(f"turn_end_token {turn_end_token!r} is not a single token of this tokenizer: set "
                             "rollout.agent.turn_end_token to the token that closes a turn in its chat template")
        rendered = tokenizer.apply_chat_template(self._STAND_IN, tokenize=False)
        after = rendered.split("\x00a\x00", 1)[1]
        if not after.startswith(turn_end_token):
            raise ValueError(f"the chat template does not close an assistant turn with {turn_end_token!r}: set "
                             "rollout.agent.turn_end_token to the token it uses")
        self._ends_before = rendered.count(turn_end_token)  # turn ends up to and including the stand-in reply's
        self.closer = after[len(turn_end_token):]  # e.g. "\n" after <|im_end|>

    def prompt_ids(self, text: str, images: int = 0) -> list[int]:
        """The first user turn and the model's header; `images` image placeholders before the text."""
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": _content(text, images)}],
                                                      add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False).input_ids

    def suffix_text(self, messages: list[dict]) -> str:
        """The text the template puts after a closed model turn for `messages`, through the next
        model turn's header."""
        full = self.tokenizer.apply_chat_template(self._STAND_IN + list(messages), add_generation_prompt=True,
                                                  tokenize=False)
        cut = -1
        for _ in range(self._ends_before):
            cut = full.index(self.turn_end, cut + 1)
        if "\x00a\x00" not in full[:cut]:
            raise ValueError("the chat template renders turns in an order miles cannot split: the appended "
                             "messages' tokens cannot be told apart from the history's")
        return full[cut + len(self.turn_end):]

    def suffix_ids(self, messages: list[dict], closed: bool) -> list[int]:
        ids = self.tokenizer(self.suffix_text(messages), add_special_tokens=False).input_ids
        # A turn cut off by its token budget has no end token yet; the appended messages close it.
        return ids if closed else [self.end_id] + ids

    def observation_ids(self, text: str, closed: bool, images: int = 0) -> list[int]:
        """An environment turn after a model turn; `images` image placeholders before the text."""
        return self.suffix_ids([{"role": self.role, "content": _content(text, images)}], closed)

    def action_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _content(text: str, images: int):
    """A message's content: the text, or with images one image part each and then the text."""
    return text if not images else [{"type": "image"}] * images + [{"type": "text", "text": text}]
