"""The engine's decode attention on the CPU (engine/cpu_attention.py): the plain form gives SDPA's
output for one query per row, hands every other call to SDPA, and the engine serves with it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from miles.engine import cpu_attention
from miles.engine.config import EngineConfig
from miles.engine.engine import Engine
from miles.engine_api.sampling import SamplingParams


def _module(heads: int, kv_heads: int):
    return SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (4, 4), (8, 1)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_one_query_per_row_gives_sdpas_output(heads, kv_heads, mask_kind):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    B, L, D = 5, 37, 32
    q = torch.randn(B, heads, 1, D, generator=g)
    k, v = torch.randn(B, kv_heads, L, D, generator=g), torch.randn(B, kv_heads, L, D, generator=g)
    # Left padding of different widths and a hole, as a batch with cached prefixes has.
    seen = torch.ones(B, L, dtype=torch.bool)
    seen[0, :10] = False
    seen[2, :30] = False
    seen[3, 5:9] = False
    mask = {"none": None, "bool": seen[:, None, None, :],
            "additive": torch.zeros(B, 1, 1, L).masked_fill(~seen[:, None, None, :], torch.finfo(torch.float32).min)}
    module = _module(heads, kv_heads)
    ours, _ = cpu_attention.decode_attention(module, q, k, v, mask[mask_kind], scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask[mask_kind], scaling=0.3)
    assert ours.shape == theirs.shape == (B, 1, heads, D)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_every_other_call_is_sdpas_own():
    g = torch.Generator().manual_seed(0)
    module = _module(8, 4)
    q, k, v = torch.randn(2, 8, 6, 16, generator=g), torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 4, 6, 16,
                                                                                                         generator=g)
    # A prefill (six queries, causal), and a single query with attention sinks passed along.
    assert torch.equal(cpu_attention.decode_attention(module, q, k, v, None)[0],
                       sdpa_attention_forward(module, q, k, v, None)[0])
    with pytest.raises(ValueError, match="softcap"):  # SDPA's own refusal: the call reached it
        cpu_attention.decode_attention(module, q[:, :, :1], k, v, None, softcap=30.0)


def test_the_engine_serves_with_it_on_the_cpu_and_decodes_what_transformers_decodes(model_dir, hf_model, ref, tokenizer):
    engine = Engine(EngineConfig(model_path=model_dir, prefix_block_size=4))
    try:
        assert engine.model.config._attn_implementation == cpu_attention.NAME
        assert hf_model.config._attn_implementation == "sdpa"  # a model loaded beside it keeps SDPA
        prompts = [tokenizer.encode(t) for t in ("12+7=", "a much longer prompt than the others, 3*4=", "9")]
        reqs = [engine.make_request(p, SamplingParams(temperature=0.0, max_new_tokens=24)) for p in prompts]
        results = engine.submit_all(reqs).result(timeout=120)
        assert [r.output_ids for r in results] == [ref.greedy(p, 24) for p in prompts]
    finally:
        engine.stop()
