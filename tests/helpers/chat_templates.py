"""Chat templates written for tests, in the styles of real model families, on the tiny tokenizer.

QWEN3_STYLE behaves as Qwen3's template does where it matters to multi-turn token bookkeeping:
  - `tools` are listed in a system block, and calls are taught as `<tool_call>{json}</tool_call>`;
  - `role: "tool"` results are folded into a user turn as `<tool_response>` blocks;
  - an assistant turn's `<think>` block is kept only after the latest user query: once a new user
    message arrives, re-rendering the conversation drops every earlier reasoning block;
  - a conversation with no user query is refused (raise_exception), so a tool message cannot be
    rendered on its own.
LLAMA3_STYLE follows Llama 3.1's shape: a begin-of-text token and a system header that is always
there (with a knowledge-date line), `<|start_header_id|>role<|end_header_id|>` turns closed by
`<|eot_id|>` with nothing after it, tool results as `ipython` turns, calls as a bare JSON object, and
message contents trimmed on every render (so a reply with surrounding whitespace is rewritten).
Its special tokens are added to the tiny tokenizer by `tokenizer_with_template(..., extra_tokens=...)`.
Transformers renders templates with trim_blocks (a newline right after a tag is dropped), so such
newlines are written as {{ '\\n' }}.
"""

from __future__ import annotations

QWEN3_STYLE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\nCall functions listed in <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Write each call as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% if ns.last_query < 0 %}{{ raise_exception('No user query found in messages.') }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'user' or m.role == 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}"
    "{% set content = m.content or '' %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query and reasoning %}<think>\n{{ reasoning }}\n</think>\n\n{% endif %}"
    "{{ content }}"
    "{% for call in m.tool_calls or [] %}"
    "{% if content or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]

LLAMA3_STYLE = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>{{ '\\n\\n' }}"
    "{% if tools %}Environment: ipython{{ '\\n' }}{% endif %}Cutting Knowledge Date: December 2023{{ '\\n\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content | trim }}{% endif %}"
    "{% if tools %}{{ '\\n\\n' }}Call a function by answering with a JSON object "
    "{\"name\": function name, \"parameters\": arguments}. Functions:"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{% endif %}<|eot_id|>"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}"
    "{% for call in m.tool_calls %}{\"name\": \"{{ call.function.name }}\", "
    "\"parameters\": {{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>{{ '\\n\\n' }}{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ '\\n\\n' }}{{ m.content | trim }}<|eot_id|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}"
)


def tokenizer_with_template(model_dir: str, template: str, out, extra_tokens: list[str] | None = None) -> str:
    """A copy of `model_dir`'s tokenizer (and config.json) with `template` as its chat template, saved to `out`."""
    import shutil
    from pathlib import Path

    from miles.models.loading import load_tokenizer

    shutil.copy(Path(model_dir) / "config.json", Path(out) / "config.json")

    tok = load_tokenizer(model_dir)
    if extra_tokens:
        tok.add_special_tokens({"additional_special_tokens": extra_tokens})
    tok.chat_template = template
    tok.save_pretrained(out)
    return str(out)
