"""Supervised warm start for the calculator example: solved episodes, most answered directly.

A share `--tool-fraction` of the demonstrations call the calculator before answering; the rest give
the answer straight away. A short warm start teaches the small model to copy a problem into a
`calc` call and the tool's result into its answer (the fixed-width layout, `07+38=`, keeps every
digit at a fixed position), but not to add in its head: it mostly answers directly and is mostly
wrong. RL then has something to find: sampled episodes that call the tool win. Episodes are
tokenized exactly as the agent loop builds them (the chat template once, then each tool turn as a
suffix), with the loss on the model's turns only.

    python examples/tool_calc/warm_start.py --model BASE_DIR --out SFT_DIR
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def episode_tokens(fmt, task, use_tool: bool) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one solved episode, built the way rollout/agent/episode.py builds them."""
    from miles.rollout.environments.tool_calc import demonstration

    ids = fmt.prompt_ids(task.text)
    mask = [0] * len(ids)
    for role, text in demonstration(task, use_tool):
        if role == "assistant":
            turn = fmt.tokenizer(text, add_special_tokens=False).input_ids + [fmt.end_id]
            ids, mask = ids + turn, mask + [1] * len(turn)
        else:
            obs = fmt.observation_ids(text, closed=True)
            ids, mask = ids + obs, mask + [0] * len(obs)
    return ids, mask


def train_on_episodes(model, data: list[tuple[list[int], list[int]]], steps: int, batch_size: int, lr: float,
                      pad_id: int, seed: int = 0, tag: str = "warm start", weight_decay: float = 0.0) -> float:
    """Next-token loss on the mask-1 tokens of (ids, mask) episodes; returns the last batch's NLL."""
    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    t0 = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for step in range(1, steps + 1):
        batch = rng.sample(data, min(batch_size, len(data)))
        T = max(len(ids) for ids, _ in batch)
        x = torch.full((len(batch), T), pad_id)
        m = torch.zeros(len(batch), T)
        att = torch.zeros(len(batch), T, dtype=torch.long)
        for i, (ids, mask) in enumerate(batch):
            x[i, :len(ids)] = torch.tensor(ids)
            m[i, :len(ids)] = torch.tensor(mask, dtype=torch.float)
            att[i, :len(ids)] = 1
        logits = model(input_ids=x, attention_mask=att).logits[:, :-1].float()  # (B, T-1, V)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # (B, T-1)
        loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps:
            print(f"[{tag}] step {step}/{steps} nll {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)",
                  file=sys.stderr, flush=True)
    return float(loss.detach())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory to start from")
    p.add_argument("--out", required=True, help="where the warm-started checkpoint is written")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--tool-fraction", type=float, default=0.3, help="share of demonstrations that use the tool")
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--no-fixed-width", dest="fixed_width", action="store_false",
                   help="unpadded problems (7+38=) instead of the fixed-width layout (07+38=) the RL run uses")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not 0 <= a.tool_fraction <= 1:
        p.error("--tool-fraction must be between 0 and 1")

    import torch

    from miles.models.loading import load_model, load_tokenizer
    from miles.data.chat import ChatFormat
    from miles.data.prompts import PromptSource, TaskConfig

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    tok = load_tokenizer(a.model)
    model = load_model(a.model).train()
    fmt = ChatFormat(tok)
    rng = random.Random(a.seed)
    # Seed offset: demonstrations come from other draws than the RL run's prompts.
    tasks = PromptSource(TaskConfig(name="arithmetic", digits=a.digits, fixed_width=a.fixed_width), "train", a.seed + 1).take(4096)
    data = [episode_tokens(fmt, t, rng.random() < a.tool_fraction) for t in tasks]
    train_on_episodes(model, data, a.steps, a.batch_size, a.lr, tok.pad_token_id, a.seed, weight_decay=a.weight_decay)
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"[tool_calc warm start] wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
