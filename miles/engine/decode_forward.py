"""The forwards over the static KV cache: a decode step (a token per slot in, next-token logits out),
and one chunk of a long prompt's prefill into a slot.

The HF model's own modules do the work (embeddings, norms, projections, MLP or MoE block, LM head),
so LoRA hooks, quantized linears and router hooks apply exactly as in the eager forward; what this
module replaces is the attention core and the cache: rotary embedding at each row's own position,
the new key and value written in place into column `pos` of the row's slot (static_kv.py), and
attention through torch's fused SDPA over columns [0, Lb) with a mask of the columns each row has.

Grouped-query attention without expanding the cache: at decode a row has one query per head, so the
G query heads that share a KV head are handed to SDPA as G query positions of that KV head, all with
the same mask. SDPA then reads each cached key and value once, where repeating the KV heads would
copy them G times.

No host synchronisation and no Python branch on tensor values, so the forward can be captured as a
CUDA graph (graphs.py). Supported: the Llama-style decoder families listed in FAMILIES, whose layers
are pre-norm attention + MLP with rotary positions; any other model decodes on the eager path.

A prefill chunk (`chunk`) computes positions [start, start + C) of one prompt in one slot, attending
to the slot's columns [0, start + C) under a causal mask (SDPA with grouped-query attention), so a
long prompt is prefilled a chunk per engine step between decode steps (model_runner.py).

Non-goals: prefilling batches of prompts (the HF forward does, model_runner.py), sliding windows, ALiBi.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from miles.engine.static_kv import StaticKV

# HF model types whose decoder layer is exactly: x + attn(input_layernorm(x)), then
# x + mlp(post_attention_layernorm(x)), attention with optional per-head q/k norms and rotary positions.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
# Rope types that recompute frequencies from the longest position seen (a host-side read).
_DYNAMIC_ROPE = ("dynamic", "longrope")


def unsupported(model) -> str | None:
    """Why `model` cannot decode over the static cache, or None when it can."""
    kind = getattr(model.config, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} is not one of {', '.join(FAMILIES)}"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"{type(model).__name__}.model has no {name}"
    if getattr(inner.rotary_emb, "rope_type", "default") in _DYNAMIC_ROPE:
        return f"rope type {inner.rotary_emb.rope_type!r} recomputes its frequencies per step"
    return None


class DecodeForward:
    """Callable: (kv, tokens (Bk,), positions (Bk,), Lb) -> logits (Bk, V) of the next token."""

    def __init__(self, model):
        reason = unsupported(model)
        if reason is not None:
            raise NotImplementedError(f"the static-KV decode does not serve this model: {reason}")
        self.model = model
        self.inner = model.model
        attn = self.inner.layers[0].self_attn
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.scaling = attn.scaling
        # The model's own rotary helper, so the keys written match the prefill's bit for bit.
        self.rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb

    def __call__(self, kv: StaticKV, tokens: torch.Tensor, pos: torch.Tensor, Lb: int) -> torch.Tensor:
        Bk = tokens.shape[0]
        pos = pos.clamp(max=kv.cap - 1)  # a finished row waiting for compaction may step past its slot
        x = self.inner.embed_tokens(tokens[:, None])  # (Bk, 1, hidden)
        cos, sin = self.inner.rotary_emb(x, pos[:, None])
        cols = torch.arange(Lb, device=tokens.device)
        # Additive mask (Bk, 1, 1, Lb): a row sees the columns it has written, the new one included.
        mask = torch.zeros((Bk, 1, 1, Lb), dtype=x.dtype, device=x.device).masked_fill_(
            (cols[None, :] > pos[:, None])[:, None, None, :], float("-inf"))
        slots = torch.arange(Bk, device=tokens.device)
        for i, layer in enumerate(self.inner.layers):
            x = x + self._attention(layer.self_attn, layer.input_layernorm(x), cos, sin, kv.k[i], kv.v[i],
                                    slots, pos, mask, Lb)
            out = layer.mlp(layer.post_attention_layernorm(x))
            x = x + (out[0] if isinstance(out, tuple) else out)
        x = self.inner.norm(x)
        return self.model.lm_head(x)[:, 0, :]  # (Bk, V)

    def _attention(self, attn, h, cos, sin, k_cache, v_cache, slots, pos, mask, Lb):
        Bk, D = h.shape[0], self.head_dim
        q = attn.q_proj(h).view(Bk, 1, self.heads, D)
        k = attn.k_proj(h).view(Bk, 1, self.kv_heads, D)
        v = attn.v_proj(h).view(Bk, 1, self.kv_heads, D)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (Bk, heads, 1, D)
        k_cache[slots, :, pos] = k[:, :, 0]  # (Bk, kv_heads, D) into column pos of each slot
        v_cache[slots, :, pos] = v[:, 0]
        G = self.heads // self.kv_heads
        q = q.reshape(Bk, self.kv_heads, G, D)  # query head h shares KV head h // G
        o = F.scaled_dot_product_attention(q, k_cache[:Bk, :, :Lb], v_cache[:Bk, :, :Lb], attn_mask=mask,
                                           scale=self.scaling)  # (Bk, kv_heads, G, D)
        return attn.o_proj(o.reshape(Bk, 1, self.heads * D))

    def chunk(self, kv: StaticKV, slot: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Prefill positions [start, start + C) of `slot` from `ids` (C,), the columns before them already
        written; returns the logits (V,) of the last position."""
        C = ids.shape[0]
        pos = torch.arange(start, start + C, device=ids.device)
        x = self.inner.embed_tokens(ids[None])  # (1, C, hidden)
        cos, sin = self.inner.rotary_emb(x, pos[None])
        # Position start + i sees the columns up to itself: (1, 1, C, start + C), True = attend.
        mask = (torch.arange(start + C, device=ids.device)[None, :] <= pos[:, None])[None, None]
        for i, layer in enumerate(self.inner.layers):
            x = x + self._chunk_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, kv.k[i], kv.v[i],
                                          slot, start, mask)
            out = layer.mlp(layer.post_attention_layernorm(x))
            x = x + (out[0] if isinstance(out, tuple) else out)
        x = self.inner.norm(x[:, -1:])
        return self.model.lm_head(x)[0, 0]  # (V,)

    def _chunk_attention(self, attn, h, cos, sin, k_cache, v_cache, slot, start, mask):
        C, D = h.shape[1], self.head_dim
        q = attn.q_proj(h).view(1, C, self.heads, D)
        k = attn.k_proj(h).view(1, C, self.kv_heads, D)
        v = attn.v_proj(h).view(1, C, self.kv_heads, D)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (1, heads, C, D)
        k_cache[slot, :, start:start + C] = k[0]
        v_cache[slot, :, start:start + C] = v[0].transpose(0, 1)
        L = start + C
        o = F.scaled_dot_product_attention(q, k_cache[slot:slot + 1, :, :L], v_cache[slot:slot + 1, :, :L],
                                           attn_mask=mask, scale=self.scaling, enable_gqa=True)  # (1, heads, C, D)
        return attn.o_proj(o.transpose(1, 2).reshape(1, C, self.heads * D))
