"""The running batch's dense KV: merging rows of different lengths, growing by a column, compacting."""

from __future__ import annotations

import torch

from miles.engine.kv_cache import BatchKV, new_cache


def _prefilled(model_config, mask: torch.Tensor, seed: int):
    """A fresh cache holding random KV for `mask`'s (R, L) columns, as a prefill would leave it."""
    g = torch.Generator().manual_seed(seed)
    cache = new_cache(model_config)
    R, L = mask.shape
    for i in range(len(cache.layers)):
        shape = (R, 2, L, 4)  # (R, H, L, D)
        cache.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), i)
    return cache


def _real_kv(kv: BatchKV, i: int) -> torch.Tensor:
    n = int(kv.mask[i].sum())
    k, v = kv.row_kv(i, 0, n)  # (layers, H, n, D)
    return torch.cat([k, v])


def test_rows_keep_their_kv_through_merge_growth_and_compaction(hf_model):
    cfg = hf_model.config
    mask_a = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0 has 2 tokens, row 1 has 3
    mask_b = torch.tensor([[0, 1, 1, 1, 1]])  # 4 tokens behind one padding column
    kv = BatchKV()
    kv.merge(_prefilled(cfg, mask_a, 0), mask_a, torch.tensor([2, 3]), torch.tensor([5, 6]))
    before = [_real_kv(kv, i) for i in range(2)]
    kv.merge(_prefilled(cfg, mask_b, 1), mask_b, torch.tensor([4]), torch.tensor([7]))
    assert kv.mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]  # right-aligned
    assert kv.next_pos.tolist() == [2, 3, 4] and kv.last_tokens.tolist() == [5, 6, 7]
    assert all(torch.equal(_real_kv(kv, i), before[i]) for i in range(2))
    alone_b = _real_kv(kv, 2)

    # A decode step writes one new column for every row into the layers' spare capacity.
    for i in range(len(kv.cache.layers)):
        new = torch.full((3, 2, 1, 4), float(i))
        kv.cache.update(new, new, i)
    kv.mask = torch.cat([kv.mask, torch.ones((3, 1), dtype=torch.long)], dim=1)
    assert kv.cache.layers[0].keys.shape == (3, 2, 6, 4)
    k, _ = kv.row_kv(0, 0, 3)
    assert torch.equal(k[:, :, :2], before[0][: len(kv.cache.layers), :, :2]) and k[1, :, 2].eq(1.0).all()

    # Dropping rows 0 and 1 cuts the columns that are padding for row 2 alone.
    kv.select([2])
    assert kv.mask.tolist() == [[1, 1, 1, 1, 1]] and kv.cache.layers[0].keys.shape == (1, 2, 5, 4)
    assert torch.equal(_real_kv(kv, 0)[:, :, :4], alone_b)
