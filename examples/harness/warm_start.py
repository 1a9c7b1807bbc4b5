"""Supervised warm start for the harness example: solved episodes of examples/harness/agent.py, most
answered directly.

Each demonstration is tokenized exactly as the session API records the agent's conversation: the
first request's messages and tools through the chat template once, the model's turns as its tokens
(a `<tool_call>` block for the calculator, then the answer), each tool result as a chat-template
suffix; the loss is on the model's turns only. A share `--tool-fraction` calls the calculator before
answering; the rest answer straight away. After a short warm start the small model copies well but
adds poorly, so RL has something to find: the sampled episodes that call the tool win.

    python examples/harness/warm_start.py --model BASE_DIR --out SFT_DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def episode_tokens(tok, fmt, agent, prompt: str, label: str, use_tool: bool) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one solved episode, as the session records it."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tools=agent.TOOLS,
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    mask = [0] * len(ids)

    def model_turn(reply: str):
        nonlocal ids, mask
        turn = tok(reply, add_special_tokens=False).input_ids + [fmt.end_id]
        ids, mask = ids + turn, mask + [1] * len(turn)

    answer = label
    if use_tool:
        expr = prompt.rstrip("=")
        model_turn("<tool_call>" + json.dumps({"name": "calc", "arguments": {"expr": expr}}) + "</tool_call>")
        answer = agent.calculate(expr)
        suffix = fmt.suffix_ids([{"role": "tool", "content": answer, "tool_call_id": "call_0"}], closed=True)
        ids, mask = ids + suffix, mask + [0] * len(suffix)
    model_turn(answer)
    return ids, mask


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory to start from")
    p.add_argument("--out", required=True, help="where the warm-started checkpoint is written")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--tool-fraction", type=float, default=0.3, help="share of demonstrations that use the tool")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch

    from miles.models.loading import load_model, load_tokenizer
    from miles.data.chat import ChatFormat
    from miles.data.prompts import PromptSource, TaskConfig

    agent = _load(HERE / "agent.py", "harness_agent")
    sft = _load(HERE.parent / "tool_calc" / "warm_start.py", "tool_calc_warm_start")  # the shared SFT loop
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    tok = load_tokenizer(a.model)
    model = load_model(a.model).train()
    fmt = ChatFormat(tok)
    rng = random.Random(a.seed)
    # Seed offset: demonstrations come from other draws than the RL run's prompts (same task as grpo.toml).
    tasks = PromptSource(TaskConfig(name="arithmetic", digits=2, fixed_width=True), "train", a.seed + 1).take(4096)
    data = [episode_tokens(tok, fmt, agent, t.text, t.label, rng.random() < a.tool_fraction) for t in tasks]
    sft.train_on_episodes(model, data, a.steps, a.batch_size, a.lr, tok.pad_token_id, a.seed,
                          tag="harness warm start", weight_decay=a.weight_decay)
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"[harness warm start] wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
