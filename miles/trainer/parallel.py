"""Tensor and expert parallel layouts through DTensor device meshes, from transformers' own plans.

transformers' distributed config shards attention/MLP projections column/row-wise (TP) and MoE
experts across ranks (EP), and keeps the pieces that must stay whole correct: Qwen3's q_norm and
k_norm act on sharded heads, so their gradients are summed over the TP group (a hand-written TP
plan that only shards the linears gets those gradients wrong). Ranks beyond one TP group become
FSDP data-parallel replicas on a second mesh dimension.
Non-goal: pipeline parallelism.
"""

from __future__ import annotations

from miles.models.dsa import stable_topk
from miles.models.loading import attention_implementation, check_model_path


def load_parallel_model(model_path: str, tp: int, ep: int, world_size: int):
    """The model laid out over `world_size` ranks. Returns (model, data-parallel size)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    check_model_path(model_path)
    width = max(tp, ep)  # ranks that hold one replica between them
    if world_size % width:
        raise ValueError(f"{world_size} ranks do not divide into groups of {width} (tensor/expert parallel size)")
    dp = world_size // width
    kwargs = {"tp_size": width}
    if ep > 1:
        kwargs["ep_size"] = ep
    if dp > 1:
        kwargs["fsdp_size"] = dp
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation=attention_implementation(model_path),
                                                 distributed_config=DistributedConfig(**kwargs))
    stable_topk(model)  # as load_model: the engine's DSA top-k (models/dsa.py)
    return model, dp
