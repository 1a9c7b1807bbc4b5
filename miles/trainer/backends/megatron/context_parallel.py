"""Context parallelism for megatron-core's local (pure torch) layers.

megatron-core 0.16.1 splits a sequence over the context-parallel (CP) ranks everywhere but in the
attention itself: its local `DotProductAttention` asserts CP = 1 and leaves CP to TransformerEngine's
ring attention, which does not exist on a CPU. This module is the core attention of the layer spec
when CP > 1, and the token bookkeeping around it.

Layout (megatron-core's load balancing for causal masks): the padded sequence of T' tokens is cut
into 2·CP chunks and CP rank r holds chunks r and 2·CP−1−r, so every rank has as many early as late
queries. megatron-core's rotary embedding already slices its table that way (rope_utils.py's
`get_pos_emb_on_this_cp_rank`); `local_chunks` cuts the input ids, labels and recorded routes the
same way.

Attention: every rank gathers all ranks' keys and values over the CP group (`_GatherChunks`: an
all-gather forward; backward, the gradient every rank computed for each key is summed over the group
and each rank keeps its own slice — an all-reduce, since gloo has no reduce-scatter), puts them in
sequence order and attends its queries to the keys at or before each query's position, in float32.
It holds the whole sequence's keys and values on every rank, unlike a ring, which is right for the
CPU and the test lengths it exists for; on a GPU TransformerEngine's attention is the one to use.

Loss: `gather_tokens` puts every rank's per-token outputs back into sequence order (backward: each
rank keeps its own slice of the gradient), so each CP rank computes the whole micro-batch's loss; the
schedule multiplies the loss by CP and DDP averages gradients over data × context ranks, which sums
the ranks' shares of the one gradient.
Non-goals: packed sequences (THD), sliding windows, attention sinks (refused by the backend's config).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.module import MegatronModule


def _cp() -> tuple[int, int, dist.ProcessGroup]:
    return mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank(), mpu.get_context_parallel_group()


def local_chunks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This CP rank's two chunks (r and 2·CP−1−r) of `x` along `dim`, whose length divides by 2·CP."""
    size, rank, _ = _cp()
    if size == 1:
        return x
    parts = x.chunk(2 * size, dim=dim)
    return torch.cat([parts[rank], parts[2 * size - 1 - rank]], dim=dim)


def _in_sequence_order(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Every rank's local tensor (chunks r and 2·CP−1−r along `dim`) → the whole sequence in order."""
    size = len(pieces)
    chunks: list[torch.Tensor | None] = [None] * (2 * size)
    for r, piece in enumerate(pieces):
        first, second = piece.chunk(2, dim=dim)
        chunks[r], chunks[2 * size - 1 - r] = first, second
    return torch.cat(chunks, dim=dim)


def _own_slice(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    parts = full.chunk(2 * size, dim=dim)
    return torch.cat([parts[rank], parts[2 * size - 1 - rank]], dim=dim)


class _GatherChunks(torch.autograd.Function):
    """All ranks' chunks in sequence order; backward sums the gradient over the ranks first when
    each rank's gradient is only its share (`reduce`), else takes this rank's slice of its own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, reduce: bool) -> torch.Tensor:
        size, rank, group = _cp()
        ctx.dim, ctx.reduce, ctx.rank, ctx.size, ctx.group = dim, reduce, rank, size, group
        pieces = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return _in_sequence_order(pieces, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if ctx.reduce:
            dist.all_reduce(grad, group=ctx.group)
        return _own_slice(grad, ctx.dim, ctx.rank, ctx.size), None, None


def gather_tokens(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Per-token outputs of every CP rank in sequence order. Each rank computes the same loss from
    them, so a rank's gradient for its own tokens is already whole: backward keeps its slice."""
    if mpu.get_context_parallel_world_size() == 1:
        return x
    return _GatherChunks.apply(x, dim, False)


def local_positions(length: int, device) -> torch.Tensor:
    """The sequence positions of this rank's `length` local tokens."""
    size, rank, _ = _cp()
    whole = torch.arange(length * size, device=device)
    return local_chunks(whole, 0)


class ContextParallelAttention(MegatronModule):
    """Causal core attention over a sequence split across the CP ranks (a drop-in for megatron-core's
    `DotProductAttention` in the local layer spec: same constructor, [s, b, heads, dim] in and
    [s, b, heads·dim] out, s this rank's tokens)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        tp = mpu.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None or attention_mask is not None:
            raise ValueError("context-parallel attention on local layers takes causal, padded sequences only "
                             "(no packed sequences, attention mask or bias)")
        s, b = query.shape[:2]
        keys = _GatherChunks.apply(key, 0, True)  # (S, b, groups, dim), S = s·CP, in sequence order
        values = _GatherChunks.apply(value, 0, True)
        if self.heads != self.groups:
            keys = keys.repeat_interleave(self.heads // self.groups, dim=2)
            values = values.repeat_interleave(self.heads // self.groups, dim=2)
        q = query.float().permute(1, 2, 0, 3)  # (b, heads, s, dim)
        k = keys.float().permute(1, 2, 3, 0)  # (b, heads, dim, S)
        scores = torch.matmul(q, k) * self.scale  # (b, heads, s, S)
        mine = local_positions(s, query.device)
        future = torch.arange(keys.shape[0], device=query.device)[None, :] > mine[:, None]  # (s, S)
        probs = self.dropout(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1))
        out = torch.matmul(probs, values.float().permute(1, 2, 0, 3))  # (b, heads, s, dim)
        return out.to(query.dtype).permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
