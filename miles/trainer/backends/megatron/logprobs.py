"""Per-token logprobs, entropy and greedy hits from logits whose vocabulary is split over the
tensor-parallel ranks, without gathering the vocabulary.

Each rank holds the logits of its vocabulary slice (B, T, V/t). The log-partition is
max + log Σ exp over all slices (two all-reduces: the max, then the sum), the target's logit comes
from the one rank whose slice holds it (a masked sum), and the entropy is log Z − Σ p·x over all
slices. The sums go through megatron-core's reduce_from_tensor_model_parallel_region (all-reduce
forward, identity backward): every TP rank computes the same loss from them, so each rank's
gradient with respect to its own slice is exactly its share. Float32 throughout, at the training
temperature, the convention trainer/forward.py keeps for the FSDP backend.
Non-goal: the loss (trainer/loss.py); logits that are not split (one TP rank: the same code, t = 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from miles.trainer.types import TokenOutputs, TokenRequest


def vocab_parallel_token_outputs(logits: torch.Tensor, targets: torch.Tensor, request: TokenRequest,
                                 group) -> TokenOutputs:
    """logits (B, T, V/t) of this rank's vocabulary slice, targets (B, T) global token ids → per-token
    (B, T) logprobs of the targets, and entropy / greedy hits when `request` asks."""
    x = logits.float()
    if request.temperature > 0:
        x = x / request.temperature
    vocab_local = x.shape[-1]
    start = dist.get_rank(group) * vocab_local if dist.get_world_size(group) > 1 else 0
    with torch.no_grad():
        top = x.max(dim=-1).values
        if dist.get_world_size(group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    z = x - top.unsqueeze(-1)  # (B, T, V/t), <= 0 everywhere, 0 at the global argmax
    log_z = torch.log(reduce_from_tensor_model_parallel_region(z.exp().sum(-1), group))  # (B, T)
    local = targets - start
    here = (local >= 0) & (local < vocab_local)
    picked = z.gather(-1, local.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1) * here
    target_z = reduce_from_tensor_model_parallel_region(picked, group)  # (B, T)
    out = TokenOutputs(logprobs=target_z - log_z)
    if request.entropy:
        p = torch.exp(z - log_z.unsqueeze(-1))
        out.entropy = log_z - reduce_from_tensor_model_parallel_region((p * z).sum(-1), group)
    if request.greedy:
        out.greedy = target_z.detach() >= 0  # the target's logit is the global maximum
    return out
