"""The running batch's dense KV: merging rows of different lengths, growing by a column, compacting; a
DSA model's indexer keys carried with it; the budget counting what a token's entry really takes."""

from __future__ import annotations

import pytest
import torch

from miles.engine.kv_cache import BatchKV, bytes_per_token, load_prefixes, new_cache, row_kv
from miles.engine.prefix_cache import PrefixCache
from miles.models.loading import load_model


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
    # Compaction gathers into buffers with room for the next step's column: appending it copies nothing.
    buffer = kv.cache.layers[0]._k.data_ptr()
    kv.cache.update(torch.zeros((1, 2, 1, 4)), torch.zeros((1, 2, 1, 4)), 0)
    assert kv.cache.layers[0]._k.data_ptr() == buffer and kv.cache.layers[0].keys.shape == (1, 2, 6, 4)


def test_dsa_layers_carry_their_indexer_keys_through_merge_growth_compaction_and_the_prefix_cache(preset_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(preset_dir("tiny-glm5"))  # indexers in layers 0, 1, 3; layer 2 reuses 1's

    def prefilled(mask, seed):
        g = torch.Generator().manual_seed(seed)
        cache = new_cache(cfg)
        R, L = mask.shape
        for i in range(len(cache.layers)):
            cache.update(torch.randn((R, 1, L, 4), generator=g), torch.randn((R, 1, L, 2), generator=g), i)
            if i != 2:
                cache.update_indexer(torch.randn((R, L, 3), generator=g), i)
        return cache

    def entry(kv, i):
        return kv.row_kv(i, 0, int(kv.mask[i].sum()))

    mask_a, mask_b = torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.tensor([[0, 1, 1, 1, 1]])
    kv = BatchKV()
    kv.merge(prefilled(mask_a, 0), mask_a, torch.tensor([2, 3]), torch.tensor([5, 6]))
    before = [entry(kv, i) for i in range(2)]
    assert [t.shape for t in before[0]] == [(4, 1, 2, 4), (4, 1, 2, 2), (3, 1, 2, 3)]  # keys, values, indexer keys
    kv.merge(prefilled(mask_b, 1), mask_b, torch.tensor([4]), torch.tensor([7]))
    alone_b = entry(kv, 2)
    assert all(torch.equal(a, b) for i in range(2) for a, b in zip(entry(kv, i), before[i]))

    # A decode step appends a column of keys, values and indexer keys; the indexer keys follow the
    # KV's capacity as it grows.
    for i in range(len(kv.cache.layers)):
        kv.cache.update(torch.zeros((3, 1, 1, 4)), torch.zeros((3, 1, 1, 2)), i)
        if i != 2:
            kv.cache.update_indexer(torch.full((3, 1, 3), float(i)), i)
    kv.mask = torch.cat([kv.mask, torch.ones((3, 1), dtype=torch.long)], dim=1)
    assert kv.cache.layers[3].indexer_keys.shape == (3, 6, 3) and kv.cache.layers[2].streams()[2:] == ()
    index = entry(kv, 0)[2]
    assert torch.equal(index[:, :, :2], before[0][2]) and index[2, :, 2].eq(3.0).all()

    kv.select([2])
    assert all(torch.equal(a[:, :, :4], b) for a, b in zip(entry(kv, 0), alone_b))

    # Through the prefix cache and back into a fresh cache, right-aligned behind a padding column.
    prefix = PrefixCache(block_size=2, max_tokens=100)
    prefix.insert([9, 8, 7, 6], lambda a, b: tuple(t[:, :, a:b] for t in alone_b))
    hit = prefix.match([9, 8, 7, 6, 5], limit=4)
    fresh = new_cache(cfg)
    load_prefixes(fresh, [hit], [hit.tokens], 5)
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    assert all(torch.equal(a, b) for a, b in zip(row_kv(fresh, mask, 0, 0, 4), alone_b))


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek-v3", "tiny-glm5"])
def test_the_budget_counts_what_the_cache_holds_per_token(preset, preset_dir):
    """MLA's entry is its compressed latent (transformers expands it at each attention): on
    tiny-deepseek-v3 576 bytes a token, where keys and values expanded per head would take 3840."""
    model = load_model(preset_dir(preset)).eval()
    cache = new_cache(model.config)
    n = 7
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + n)[None], cache=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.streams())
    assert bytes_per_token(model) == held // n
    if preset == "tiny-deepseek-v3":
        assert bytes_per_token(model) == 576


def test_a_decode_step_hands_the_model_the_mask_transformers_would_build(hf_model):
    from types import SimpleNamespace

    from transformers.masking_utils import create_causal_mask

    from miles.engine.model_runner import ModelRunner, _takes_prepared_mask

    assert _takes_prepared_mask(hf_model)
    runner = SimpleNamespace(_prepared_masks=True)
    cache = _prefilled(hf_model.config, torch.ones((3, 5), dtype=torch.long), 0)
    embeds = torch.zeros((3, 1, hf_model.config.hidden_size))
    # Left padding, a hole between a cached prefix and the computed suffix, and nothing padded.
    for mask in (torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 0, 0, 1, 1, 1]]),
                 torch.ones((3, 6), dtype=torch.long)):
        ours = ModelRunner._decode_mask(runner, mask)
        theirs = create_causal_mask(config=hf_model.config, inputs_embeds=embeds, attention_mask=mask, cache=cache,
                                    position_ids=torch.tensor([[4], [5], [3]]))
        if theirs is None:
            assert ours is mask  # transformers' own path, which skips the mask
        else:
            assert create_causal_mask(config=hf_model.config, inputs_embeds=embeds, attention_mask=ours,
                                      cache=cache, position_ids=torch.tensor([[4], [5], [3]])) is ours
            assert torch.equal(ours, theirs) and ours.dtype == theirs.dtype
