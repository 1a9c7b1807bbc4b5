"""Mixture-of-experts routing seen from outside the model: which modules route, a hook on their
decisions, and the compact encoding of routed expert ids that engines return and trainers replay.

The encoding is SGLang's: base64 of the int32 array (tokens, MoE layers, top_k), one row per token
that went through the model (prompt + completion - 1: the last sampled token is never fed back).
Routers are the `mlp.gate` modules of HF MoE blocks whose forward returns
(router_logits, top-k weights, top-k expert ids), as Qwen3-MoE's does; hooking that output lets
an engine record the ids and a trainer substitute them without forking the model code.
Non-goal: routers of other shapes (shared-expert gates, grouped top-k); they are refused.
"""

from __future__ import annotations

import base64
from contextlib import contextmanager
from typing import Callable

import torch


def moe_shape(config) -> tuple[int, int] | None:
    """(MoE layers, experts per token) of an HF model config, or None for a dense model."""
    c = getattr(config, "get_text_config", lambda: config)()
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0
    top_k = getattr(c, "num_experts_per_tok", 0) or 0
    if not experts or not top_k:
        return None
    step = getattr(c, "decoder_sparse_step", 1) or 1
    dense_layers = set(getattr(c, "mlp_only_layers", None) or ())
    layers = [i for i in range(c.num_hidden_layers) if i not in dense_layers and (i + 1) % step == 0]
    return (len(layers), top_k) if layers else None


def routers(model) -> list[torch.nn.Module]:
    """The router module of every MoE layer, in layer order (empty for a dense model)."""
    shape = moe_shape(model.config)
    if shape is None:
        return []
    found = [m for name, m in model.named_modules()
             if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "num_experts")]
    if len(found) != shape[0]:
        raise NotImplementedError(
            f"{type(model).__name__}: found {len(found)} top-k routers for {shape[0]} MoE layers; routed-expert "
            "capture and replay support Qwen3-MoE-style routers (mlp.gate returning logits, weights, ids)")
    return found


@contextmanager
def hook_routers(modules: list, fn: Callable[[int, tuple], tuple | None]):
    """Call fn(moe_layer_index, (logits, weights, ids)) after each of `modules` (from `routers`); a
    tuple it returns replaces the router's output. Runs before any hook the model already has (e.g.
    expert-parallel index remapping), so fn sees and sets global expert ids."""
    handles = [m.register_forward_hook(lambda _m, _a, out, i=i: fn(i, out), prepend=True)
               for i, m in enumerate(modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def encode_routed_experts(ids: torch.Tensor) -> str:
    """(tokens, layers, top_k) integer ids → base64 of little-endian int32, SGLang's wire format."""
    return base64.b64encode(ids.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routed_experts(data: str, num_layers: int, top_k: int) -> torch.Tensor:
    """The inverse of encode_routed_experts: a (tokens, layers, top_k) int64 tensor."""
    import numpy as np

    raw = np.frombuffer(base64.b64decode(data), dtype=np.int32)
    if raw.size % (num_layers * top_k):
        raise ValueError(f"routed experts hold {raw.size} ids, not a whole number of tokens × {num_layers} MoE "
                         f"layers × top-{top_k}: they were recorded by a different model than this one")
    return torch.from_numpy(raw.astype(np.int64)).view(-1, num_layers, top_k)
