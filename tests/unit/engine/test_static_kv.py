"""The static KV cache holds each row's keys and values where the dense batch cache does: after merges
of prompts of different lengths and a compaction, every row reads back the same KV, positions and next
tokens from both."""

from __future__ import annotations

import torch
from transformers import Qwen3Config

from miles.engine import kv_cache
from miles.engine.kv_cache import BatchKV
from miles.engine.static_kv import StaticKV

LAYERS, H, D = 2, 2, 4


def _config():
    return Qwen3Config(num_hidden_layers=LAYERS, num_key_value_heads=H, head_dim=D)


def _prefill(lens: list[int], seed: int):
    """A right-aligned prefill cache like the model runner's, with random KV."""
    g = torch.Generator().manual_seed(seed)
    R, L = len(lens), max(lens)
    mask = torch.zeros((R, L), dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, L - n:] = 1
    cache = kv_cache.new_cache(_config())
    for layer in range(LAYERS):
        cache.update(torch.randn((R, H, L, D), generator=g), torch.randn((R, H, L, D), generator=g), layer)
    return cache, mask, torch.tensor(lens), torch.arange(R) + 100 * seed


def _check_same(dense: BatchKV, static: StaticKV, lens: list[int]):
    assert static.next_pos.tolist() == dense.next_pos.tolist() == lens
    assert static.last_tokens.tolist() == dense.last_tokens.tolist()
    for i, n in enumerate(lens):
        for a, b in ((0, n), (1, n - 1)):
            dk, dv = dense.row_kv(i, a, b)
            sk, sv = static.row_kv(i, a, b)
            assert torch.equal(dk, sk) and torch.equal(dv, sv)


def test_merges_and_compaction_keep_every_rows_kv():
    dense, static = BatchKV(), StaticKV(LAYERS, H, D, slots=8, cap=32, dtype=torch.float32, device=torch.device("cpu"))
    for seed, lens in ((1, [3, 7]), (2, [5, 2, 9])):
        parts = _prefill(lens, seed)
        dense.merge(*parts)
        static.merge(*parts)
    lens = [3, 7, 5, 2, 9]
    _check_same(dense, static, lens)
    dense.select([1, 3, 4])
    static.select([1, 3, 4])
    _check_same(dense, static, [7, 2, 9])
    # A slot freed by compaction is padding: it decodes a dummy token at position 0.
    assert static.inputs(4)[1].tolist() == [7, 2, 9, 0]


def test_advance_moves_positions_and_tokens_and_reset_forgets_rows():
    static = StaticKV(LAYERS, H, D, slots=4, cap=8, dtype=torch.float32, device=torch.device("cpu"))
    static.merge(*_prefill([7, 2], 1))
    static.advance(torch.tensor([11, 12]))
    assert static.next_pos.tolist() == [8, 3] and static.last_tokens.tolist() == [11, 12]
    static.advance(torch.tensor([13, 14]))
    assert static.lens == [8, 4]  # the host mirror stops at the capacity; the forward clamps the same way
    static.reset()
    assert static.n == 0 and static.next_pos is None and static.allocated
    static.free()
    assert not static.allocated
