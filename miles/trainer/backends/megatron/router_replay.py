"""Rollout Routing Replay (R3) inside megatron-core's routers: every MoE layer's `TopKRouter` first
makes its own top-k choice, which is counted against the engine's (the mismatch rate, as on FSDP),
then hands the token dispatcher the engine's experts instead, weighted as the model's HF router
family weighs them (models/routers.py through trainer/r3.py's `replay_choice`), so a token whose
routing already agreed keeps its forward bit for bit and the router keeps its gradient.

Token order: megatron-core routes a micro-batch's tokens sequence-major ([T', B] flattened, T' the
padded width) and, under sequence parallelism, each TP rank routes its contiguous slice of T'; the
engine's ids (B, T, MoE layers, k) are laid out the same way here, after taking this context-parallel
rank's two chunks of T'. Expert parallelism needs nothing more: routing happens before dispatch, on
global expert ids.

The routing is replaced per router instance (`TopKRouter.routing`, megatron-core 0.16.1
transformer/moe/router.py line 545), only inside the context, by calling the original and replacing
its (probs, routing_map); nothing of megatron-core is copied.
Non-goals: recomputed activations (the recompute would route outside the context), refused at config
load; families other than those REPLAY_ROUTERS names.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as mpu
from megatron.core.transformer.moe.router import TopKRouter

from miles.models.routers import ROUTER_FAMILIES
from miles.trainer.backends.megatron import REPLAY_ROUTERS
from miles.trainer.r3 import replay_choice


def replay_family(hf_config):
    if hf_config.model_type not in REPLAY_ROUTERS:
        raise ValueError(f"trainer.backend = 'megatron' replays routing for {', '.join(REPLAY_ROUTERS)} models, not "
                         f"{hf_config.model_type!r}: set trainer.routing_replay = false, or trainer.backend = 'fsdp'")
    return ROUTER_FAMILIES[REPLAY_ROUTERS[hf_config.model_type]](hf_config)


def engine_ids_in_router_order(routed: torch.Tensor, width: int, sequence_parallel: bool,
                               context_chunks=lambda x, dim: x, rows: int | None = None) -> torch.Tensor:
    """(B, T, layers, k) engine ids -> (N, layers, k) in the order this rank's routers see tokens:
    padded with -1 to `width` (and to `rows` rows, as a pipeline pads), this context-parallel rank's
    chunks (`context_chunks(x, dim)`), sequence-major, this TP rank's slice under sequence parallelism."""
    B, T, layers, k = routed.shape
    padded = torch.full((rows or B, width, layers, k), -1, dtype=routed.dtype, device=routed.device)
    padded[:B, :T] = routed
    order = context_chunks(padded, 1).transpose(0, 1)  # (T'/CP, B, layers, k)
    if sequence_parallel:
        order = order.chunk(mpu.get_tensor_model_parallel_world_size())[mpu.get_tensor_model_parallel_rank()]
    return order.reshape(-1, layers, k)


@contextlib.contextmanager
def replaying(chunks, family, engine: torch.Tensor, replay: bool, sums: dict):
    """Inside: every TopKRouter of `chunks` routes by `engine` (N, layers, k), counting into `sums`."""
    routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]

    def wrap(router):
        original = router.routing

        def routing(logits, padding_mask=None):
            probs, routing_map = original(logits, padding_mask=padding_mask)  # (N, E) each
            flat = logits.reshape(-1, logits.shape[-1])
            k = router.topk
            ids = routing_map.to(torch.int8).topk(k, dim=-1).indices  # (N, k) the experts it chose
            out = replay_choice(family, engine[:, router.layer_number - 1], (flat, probs.gather(1, ids), ids),
                                replay, sums)
            if out is None:
                return probs, routing_map
            _, weights, ids = out
            probs = torch.zeros_like(probs).scatter(1, ids, weights)
            routing_map = torch.zeros_like(routing_map).scatter(1, ids, True)
            return probs, routing_map
        return routing

    for r in routers:
        r.routing = wrap(r)
    try:
        yield
    finally:
        for r in routers:
            del r.routing  # back to the class's method
