"""Attention masks for models with sliding-window layers (GPT-OSS alternates them with full ones).

The engine's KV columns are not token positions: rows are right-aligned with left padding, and a
prefill that reads a cached prefix leaves padding between that prefix and the computed suffix
(kv_cache.py). transformers' own masks measure the window in columns, so the engine hands the model
its masks itself, one per layer type, measuring distance in token positions read off the 2-D mask:
a query at position q sees keys at positions k with k <= q, and in a sliding layer q - k < window,
as transformers' `sliding_window_overlay` does.

Sliding layers keep the KV of every token (exact; the prefix cache stores and reuses it like any
other layer's), so the window saves no memory here. Non-goal: dropping KV that left every window.
"""

from __future__ import annotations

import torch

# Layer types a config's `layer_types` may name, and whether their attention is windowed.
_WINDOWED = {"sliding_attention": True, "full_attention": False}


def windowed(model_config) -> bool:
    """Whether the model has sliding-window layers whose masks the engine builds."""
    c = model_config.get_text_config()
    return bool(getattr(c, "sliding_window", None)) and "sliding_attention" in (getattr(c, "layer_types", None) or ())


def unsupported_layer_types(model_config) -> list[str]:
    """Layer types of a windowed model the engine has no mask for."""
    return sorted(set(model_config.get_text_config().layer_types) - set(_WINDOWED))


def layer_masks(model_config, mask: torch.Tensor, queries: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{layer type: additive mask (B, 1, queries, L)} for a forward whose last `queries` columns of the
    (B, L) 0/1 `mask` are being computed; 0 where attention is allowed, the dtype's minimum elsewhere
    (padding query columns see their row's earlier tokens; their outputs are never read)."""
    window = model_config.get_text_config().sliding_window
    real = mask.bool()  # (B, L)
    pos = mask.long().cumsum(-1) - 1  # (B, L) each column's token position (padding: the previous token's)
    q = pos[:, -queries:, None]  # (B, S, 1)
    k = pos[:, None, :]  # (B, 1, L)
    # Padding columns repeat the previous token's position: `real` keeps them out as keys.
    causal = real[:, None, :] & (k <= q)  # (B, S, L)
    out = {}
    for kind, is_windowed in _WINDOWED.items():
        allowed = causal & (q - k < window) if is_windowed else causal
        out[kind] = torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)[:, None]
    return out
