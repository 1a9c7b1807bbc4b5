"""Mixture-of-experts routing seen from outside the model: which layers are MoE, their routers, a hook
on their decisions, and the compact encoding of routed expert ids that engines return and trainers replay.

The encoding is SGLang's: base64 of the int32 array (tokens, MoE layers, top_k), one row per token
that went through the model (prompt + completion - 1: the last sampled token is never fed back).
Routers are the modules of HF MoE blocks whose forward returns (router_logits, top-k weights, top-k
expert ids); hooking that output lets an engine record the ids and a trainer substitute them without
forking the model code. Which router classes those are, and how each weighs its experts, is
models/routers.py; any other router is refused, never replayed approximately.
"""

from __future__ import annotations

import base64
from contextlib import contextmanager
from typing import Callable

import torch

from miles.models.routers import Router, UnknownRouter, find_routers


def moe_layers(config) -> list[int]:
    """Indices of an HF config's decoder layers whose MLP is a routed mixture of experts (empty: dense).

    Read the way each family's modeling code builds its layers: per-layer type lists (`mlp_layer_types`
    of GLM-5 and DeepSeek-V4, Nemotron-H's `layers_block_type`), dense first layers
    (`first_k_dense_replace`: DeepSeek-V3/Kimi, GLM-4.5), else Qwen's `mlp_only_layers` and
    `decoder_sparse_step`."""
    c = getattr(config, "get_text_config", lambda: config)()
    experts = (getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
               or getattr(c, "n_routed_experts", None) or 0)
    if not experts or not getattr(c, "num_experts_per_tok", 0):
        return []
    n = c.num_hidden_layers
    kinds = getattr(c, "mlp_layer_types", None)
    if kinds:
        return [i for i in range(n) if kinds[i] not in ("dense", "mlp")]
    blocks = getattr(c, "layers_block_type", None)
    if blocks and getattr(c, "model_type", "") == "nemotron_h":
        return [i for i in range(n) if blocks[i] == "moe"]
    first_dense = getattr(c, "first_k_dense_replace", None)
    if first_dense is not None:
        return list(range(first_dense, n))
    step = getattr(c, "decoder_sparse_step", 1) or 1
    dense_layers = set(getattr(c, "mlp_only_layers", None) or ())
    return [i for i in range(n) if i not in dense_layers and (i + 1) % step == 0]


def moe_shape(config) -> tuple[int, int] | None:
    """(MoE layers, experts per token) of an HF model config, or None for a dense model."""
    layers = moe_layers(config)
    if not layers:
        return None
    return len(layers), getattr(config, "get_text_config", lambda: config)().num_experts_per_tok


def model_routers(model) -> list[Router]:
    """Every MoE layer's router with its family, in layer order (empty for a dense model). Raises
    UnknownRouter (naming the class) for routers miles cannot record or replay exactly. Call it only
    where routing is recorded or replayed: serving and training without R3 never inspect routers."""
    shape = moe_shape(model.config)
    return find_routers(model, shape[0]) if shape is not None else []


def replay_refusal(config) -> str | None:
    """Why the routing of `config`'s model cannot be recorded and replayed exactly, or None when it can.
    Builds the model on the meta device (no memory, no weights) to see its router classes."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # a vision-language config: its language model holds the routers
            model = AutoModelForImageTextToText.from_config(config)
    try:
        model_routers(model)
    except UnknownRouter as e:
        return str(e)
    return None


def routers(model) -> list[torch.nn.Module]:
    """The router module of every MoE layer, in layer order (see model_routers)."""
    return [r.module for r in model_routers(model)]


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
