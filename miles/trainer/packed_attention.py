"""Attention over a packed row at the cost of its sequences, not of the row.

A packed micro-batch (batching.py, `trainer.pack_sequences`) is one row of N tokens holding many
sequences end to end, each restarting its positions at 0. transformers' SDPA path keeps them apart with
a block-diagonal causal mask of N x N: it builds that mask and SDPA computes every entry of it, so a
row of 64 sequences of 50 tokens pays for 3,200² scores where its sequences need 64 x 50². On a CPU,
where no varlen kernel exists, that made attention most of a packed training step.

Here the sequences are gathered into a few padded batches of similar lengths (`Plan`: longest first, a
batch closes when a sequence is shorter than its longest over √2, so padding at most doubles a batch's
attention), each batch runs SDPA's causal kernel without a mask, and the real positions are gathered
back in row order. Right padding is harmless under a causal mask: a real query only sees keys at or
before it, all real; the padded queries' outputs are dropped. Gradients flow through the gathers.

The trainer's policy runs under `NAME`, which is transformers' SDPA for every call that does not hand
over a plan (padded micro-batches, shared prompts, generation), mask included. `logits` runs a packed
forward: the plan reaches every attention call as a keyword (so a layer recomputed for activation
checkpointing gets it again), and while the model builds its masks none is built (no N x N mask).
Served: the decoder families whose every layer is full causal attention through the model's attention
interface (FAMILIES, no sliding window); any other model keeps transformers' masked path.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "miles_packed_sdpa"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
_PLANNED: ContextVar[bool] = ContextVar("miles_packed_forward", default=False)


@dataclass(frozen=True)
class Plan:
    """Where the sequences of a packed row go for attention.
    `gathers[b]`: (n_b, L_b) row positions of batch b's sequences, padded by repeating a real position;
    `order`: (N,) for each row position, where its output lies in the batches' real outputs, concatenated."""
    gathers: tuple[torch.Tensor, ...]
    keeps: tuple[torch.Tensor, ...]  # (R_b,) the real entries of gathers[b].flatten()
    order: torch.Tensor

    @classmethod
    def of(cls, lengths: list[int], device=None) -> "Plan":
        if not lengths or min(lengths) < 1:
            raise ValueError(f"a packed row needs sequences of at least one token, got lengths {lengths}")
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        by_length = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches: list[list[int]] = []
        for i in by_length:
            if batches and lengths[i] * math.sqrt(2) >= lengths[batches[-1][0]]:
                batches[-1].append(i)
            else:
                batches.append([i])
        gathers, keeps, placed = [], [], []
        for members in batches:
            width = lengths[members[0]]
            cols = torch.arange(width)
            lens = torch.tensor([lengths[i] for i in members])
            first = torch.tensor([starts[i] for i in members])
            real = cols[None, :] < lens[:, None]  # (n, width)
            # Padded columns read the sequence's first token: any real position will do, its output is dropped.
            gathers.append(torch.where(real, first[:, None] + cols[None, :], first[:, None]))
            keeps.append(real.flatten().nonzero().squeeze(1))
            placed.append(gathers[-1].flatten()[keeps[-1]])
        placed_at = torch.cat(placed)  # row position of each concatenated real output
        order = torch.empty_like(placed_at)
        order[placed_at] = torch.arange(placed_at.numel())
        return cls(tuple(g.to(device) for g in gathers), tuple(k.to(device) for k in keeps), order.to(device))

    def to(self, device) -> "Plan":
        return Plan(tuple(g.to(device) for g in self.gathers), tuple(k.to(device) for k in self.keeps),
                    self.order.to(device))


def serves(model) -> str | None:
    """Why `model` cannot attend packed rows by plan, or None when it can."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAMILIES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {', '.join(FAMILIES)}"
    if cfg._attn_implementation not in ("sdpa", NAME):
        return f"attention implementation {cfg._attn_implementation!r} is not sdpa"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"]):
        return "not every layer is full attention"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    return None


def enable(model) -> bool:
    """Run `model` under NAME when it is served (see `serves`); True when it now is."""
    if serves(model) is not None:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _mask)
    model.set_attn_implementation(NAME)
    return True


def active(model) -> bool:
    """Whether `model` runs under NAME (`enable` took it)."""
    return model.config._attn_implementation == NAME


def logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The logits (1, N, V) of a packed row whose sequences `plan` lays out (model under NAME)."""
    token = _PLANNED.set(True)
    try:
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, packed_plan=plan).logits
    finally:
        _PLANNED.reset(token)


def _mask(*args, **kwargs):
    """SDPA's mask, except during a planned forward, whose attention needs none."""
    if _PLANNED.get():
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              packed_plan: Plan | None = None, **kwargs):
    """transformers' attention interface: (B, H, N, D) query, (B, Hkv, N, D) keys and values in,
    (B, N, H, D) out. Without a plan, SDPA as transformers runs it."""
    if packed_plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a packed plan covers one row, got a batch of {query.shape[0]}")
    H, N, D = query.shape[1:]
    groups = H // key.shape[1]
    q, k, v = query[0], key[0], value[0]  # (heads, N, D)
    outs = []
    for gather, keep in zip(packed_plan.gathers, packed_plan.keeps):
        n, width = gather.shape
        flat = gather.flatten()

        def take(t):
            return t.index_select(1, flat).view(t.shape[0], n, width, D).transpose(0, 1)  # (n, heads, width, D)

        kb, vb = take(k), take(v)
        if groups > 1:
            kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(take(q), kb, vb, dropout_p=dropout, is_causal=True, scale=scaling)
        outs.append(o.transpose(1, 2).reshape(n * width, H, D).index_select(0, keep))
    out = torch.cat(outs).index_select(0, packed_plan.order)  # (N, H, D) in row order
    return out[None], None
