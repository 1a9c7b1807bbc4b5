"""Converters: the trainer's full tensors → the names and layouts the engine loads.

A converter takes the iterator of (HF name, full tensor) pairs and yields (engine name, tensor)
pairs, or lists of them that must land in the same bucket (the engine loads them together, e.g.
the pieces of a fused projection or every expert of one MoE layer). Converters are chosen per
architecture (the HF `model_type`) from CONVERTERS, or given as `module:function`.
The built-in engine and SGLang load Hugging Face names, so the default is the identity.
Non-goals: tensor-parallel re-sharding for the engine (engines load full tensors).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

from miles.registry import Registry

Converter = Callable[[Iterable[tuple[str, object]]], Iterator]


def hf(named):
    """Identity: the engine loads Hugging Face names and layouts."""
    yield from named


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.\d+\.")


def moe_experts_together(named):
    """Hugging Face names, with every expert of one MoE layer in one bucket (engines that load a
    layer's experts as one fused tensor need all of them in the same update call)."""
    group, key = [], None
    for name, t in named:
        m = _EXPERT.match(name)
        k = m.group(1) if m else None
        if group and k != key:
            yield group
            group = []
        if k is None:
            yield name, t
        else:
            group.append((name, t))
        key = k
    if group:
        yield group


def fuse_qkv(named):
    """Fused attention input projection (qkv_proj = cat(q, k, v) along rows), for engines that load it so.
    q, k and v are held back until all three of a layer arrived, then travel as one tensor."""
    import torch

    pending: dict[str, dict[str, object]] = {}
    for name, t in named:
        for part in ("q_proj", "k_proj", "v_proj"):
            suffix = f".self_attn.{part}.weight"
            if name.endswith(suffix):
                prefix = name[: -len(suffix)]
                parts = pending.setdefault(prefix, {})
                parts[part] = t
                if len(parts) == 3:
                    del pending[prefix]
                    yield f"{prefix}.self_attn.qkv_proj.weight", torch.cat(
                        [parts["q_proj"], parts["k_proj"], parts["v_proj"]], dim=0)
                break
        else:
            yield name, t
    if pending:
        raise ValueError(f"fuse_qkv: layers {sorted(pending)} lack one of q_proj/k_proj/v_proj")


CONVERTERS: Registry[Converter] = Registry("weight converter", arity=1, hint=" (or 'auto': by the model's type)")
CONVERTERS.register("hf", hf)
CONVERTERS.register("moe_experts_together", moe_experts_together)
CONVERTERS.register("fuse_qkv", fuse_qkv)
# Architectures whose engine layout differs from plain HF names (model_type -> converter name).
BY_MODEL_TYPE: dict[str, str] = {"qwen3_moe": "moe_experts_together", "mixtral": "moe_experts_together"}


def get_converter(name: str, model_type: str | None = None) -> Converter:
    """By name, by `module:function`, or ("auto") by the model's type; RegistryError (a ValueError) if none."""
    if name == "auto":
        return CONVERTERS.get(BY_MODEL_TYPE.get(model_type or "", "hf"))
    return CONVERTERS.get(name)
