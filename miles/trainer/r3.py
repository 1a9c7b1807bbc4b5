"""Rollout Routing Replay (R3): the trainer routes each token to the experts the engine chose.

In a mixture-of-experts model a tiny numeric difference between engine and trainer (bf16 vs fp32,
other kernels, other batch shapes) flips which experts a token goes to; the gradient then flows
through experts that never produced the token. The engine records its top-k ids per token and MoE
layer (Sample.routed_experts); inside `routing_replay` every router of the policy first computes its
own top-k (counted against the engine's: the mismatch rate, measured before replay) and, with
replay on, hands the experts the engine's ids instead. The gate weights are recomputed from the
current router logits for the replayed experts exactly as that router family does (models/routers.py:
softmax or sigmoid, renormalised, scaled), so a token whose routing already agreed keeps its forward
bit for bit, and the router still gets a gradient and keeps learning.

Only the policy forward is wrapped; reference and critic are separate modules and route freely.
Tokens without recorded experts (padding, tokens after the last engine call) route freely too.
Non-goal: replay in the engine (routing there is what is being recorded).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from miles.models.moe import decode_routed_experts, hook_routers
from miles.models.routers import Router


def routed_tensor(seqs, offsets: list[tuple[int, int]], shape: tuple[int, int], rows: int, width: int):
    """(rows, width, MoE layers, top_k) engine expert ids laid out like the micro-batch's tokens, -1
    where none were recorded; None when no sequence carries any. `offsets[i]` = (row, first column)
    of sequence i."""
    if not any(s.routed_experts for s in seqs):
        return None
    layers, top_k = shape
    out = torch.full((rows, width, layers, top_k), -1, dtype=torch.long)
    for s, (r, off) in zip(seqs, offsets):
        if not s.routed_experts:
            continue
        ids = decode_routed_experts(s.routed_experts, layers, top_k)  # (n, layers, top_k)
        if len(ids) > len(s.tokens):
            raise ValueError(f"routed experts cover {len(ids)} tokens but the sequence has {len(s.tokens)}: "
                             "they belong to another sequence")
        out[r, off:off + len(ids)] = ids
    return out


def check_sequences(seqs) -> None:
    """Replay on but experts missing would silently train with free routing; refuse instead."""
    missing = sum(not s.routed_experts for s in seqs)
    if missing:
        raise ValueError(f"trainer.routing_replay is on but {missing} of {len(seqs)} sequences carry no routed "
                         "experts: a custom generate function must send return_routed_experts when "
                         "GenerateContext.return_routed_experts is set and keep meta_info.routed_experts on the Sample")


def routing_replay(model_routers: list[Router], routed: torch.Tensor | None, replay: bool, sums: dict):
    """Context for one policy forward over a micro-batch whose engine routing is `routed`
    (B, T, layers, top_k). Adds to `sums`: r3_pairs (token × layer pairs with recorded experts) and
    r3_mismatch (those where the trainer's own top-k set differs from the engine's)."""
    if routed is None or not model_routers:
        return nullcontext()
    return _replay(model_routers, routed, replay, sums)


@contextmanager
def _replay(model_routers, routed, replay, sums):
    k = routed.shape[-1]

    def on_router(layer: int, out):
        # N = B*T in the micro-batch's order
        engine = routed[:, :, layer].reshape(-1, k)
        return replay_choice(model_routers[layer].family, engine, out, replay, sums)

    with hook_routers([r.module for r in model_routers], on_router):
        yield


def replay_choice(family, engine: torch.Tensor, out: tuple, replay: bool, sums: dict):
    """One router's forward under replay: `out` = (logits (N, E), weights (N, k), ids (N, k)) as the
    router chose, `engine` (N, k) the engine's ids for the same N tokens (-1: none recorded). Counts the
    mismatch into `sums`; with `replay`, returns (logits, weights, ids) with the engine's ids and the
    family's weights for them (None: keep the router's own)."""
    logits, weights, ids = out
    engine = engine.to(ids.device)
    known = engine[:, 0] >= 0
    with torch.no_grad():
        differs = (ids.sort(-1).values != engine.sort(-1).values).any(-1) & known
        sums["r3_pairs"] = sums.get("r3_pairs", 0.0) + float(known.sum())
        sums["r3_mismatch"] = sums.get("r3_mismatch", 0.0) + float(differs.sum())
    if not replay:
        return None
    ids = torch.where(known[:, None], engine, ids)
    return logits, family.weights(logits, ids, weights.dtype), ids
