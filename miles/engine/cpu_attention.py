"""Decode attention on the CPU as two batched matmuls.

A decode step asks attention for one query per row over the row's cached keys and values. On the CPU,
torch's fused SDPA kernel (`_scaled_dot_product_flash_attention_for_cpu`) tiles that single query as
it would a long one, and on the engine's decode shapes (up to a few hundred rows, a few hundred
cached columns, head_dim 32-128) it takes about twice as long as the plain form: scores = q·kᵀ, masked
softmax, scores·v, with the query heads that share a KV head stacked as one matrix (no repeated KV),
so each cached key and value is read once.

`install(model)` registers that form under its own attention implementation name (its masks are
SDPA's) and switches the engine's model to it. Every other call (a prefill, several queries, a
model passing attention kwargs SDPA-only paths understand: sinks, position biases, soft-capping)
goes to transformers' SDPA function unchanged, so only the decode step's core changes. The trainer's
model is not touched: the two forwards agree to float32 rounding, as they already did across SDPA's
kernels (`train/rollout_logprob_abs_diff` ~1e-7).

Non-goals: CUDA (SDPA's kernels and the fast decode path serve it), sliding windows and attention
sinks (those models keep SDPA for every call).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from miles.engine.decode_forward import FAMILIES

NAME = "miles_cpu_decode"
# Attention kwargs whose presence means the call needs more than the plain form (then SDPA serves it).
_SDPA_ONLY = ("s_aux", "sinks", "position_bias", "softcap", "sliding_window")


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     is_causal=None, **kwargs):
    """transformers' attention-function contract: query (B, H, Q, D), key/value (B, KVH, L, D), mask
    None, boolean (True = attend) or additive, broadcastable to (B, H, Q, L); returns (B, Q, H, D)."""
    B, H, Q, D = query.shape
    KVH, L = key.shape[1], key.shape[2]
    plain = Q == 1 and query.device.type == "cpu" and not dropout and H % KVH == 0 \
        and not any(kwargs.get(k) is not None for k in _SDPA_ONLY) \
        and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1
                                        and attention_mask.shape[-1] == L))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    G = H // KVH
    scale = scaling if scaling is not None else D ** -0.5
    q = query.reshape(B, KVH, G, D)  # query head h reads KV head h // G
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)  # (B, KVH, G, L)
    if attention_mask is not None:
        # (B or 1, 1, 1, L): one mask for every head of a row, broadcast over (KVH, G)
        if attention_mask.dtype == torch.bool:
            scores.masked_fill_(~attention_mask, float("-inf"))
        else:
            scores.add_(attention_mask)
    out = torch.matmul(torch.softmax(scores, dim=-1), value)  # (B, KVH, G, D)
    return out.reshape(B, 1, H, D), None


def masked_by_sdpa(model) -> bool:
    """Whether every layer of `model` is masked by transformers' create_causal_mask for SDPA alone (the
    decode_forward families without sliding windows in effect, on SDPA or on this module's form): one
    mask per row, shared by its heads, which a decode step can hand the model prepared (model_runner.py)."""
    c = model.config.get_text_config()
    return (c.model_type in FAMILIES and model.config._attn_implementation in ("sdpa", NAME)
            and "sliding_attention" not in (getattr(c, "layer_types", None) or ())
            and (getattr(c, "sliding_window", None) is None or c.model_type in ("qwen2", "qwen3")))


def install(model) -> bool:
    """Switch `model` (on the CPU) to the plain decode attention; False when it does not serve it."""
    if next(model.parameters()).device.type != "cpu" or not masked_by_sdpa(model):
        return False
    AttentionInterface.register(NAME, decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
