"""Any causal LM transformers loads from a directory is served, with the same greedy outputs as generate()."""

from __future__ import annotations

import pytest
import torch

ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                     "decoder_sparse_step": 1}),
}


def _build(arch: str, out, tokenizer_dir: str) -> str:
    import transformers
    from transformers import AutoModelForCausalLM

    from miles.models.loading import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    cls, extra = ARCHS[arch]
    cfg = getattr(transformers, cls)(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=256, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # varied logits, so greedy sequences differ between prompts
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_architecture_greedy_matches_transformers(arch, tmp_path, tiny_model_dir):
    from miles.models.loading import load_model
    from miles.engine.config import EngineConfig
    from miles.engine.engine import Engine
    from miles.engine_api.sampling import SamplingParams

    path = _build(arch, tmp_path / arch, tiny_model_dir)
    hf = load_model(path).eval()
    engine = Engine(EngineConfig(model_path=path, prefix_block_size=4))
    try:
        prompts = [list(range(3, 3 + n)) for n in (9, 14, 5)] + [list(range(3, 12)) + [40, 41]]
        params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
        futures = [engine.submit(engine.make_request(p, params)) for p in prompts]  # batched, mixed lengths
        for p, f in zip(prompts, futures):
            with torch.no_grad():
                ids = torch.tensor([p])
                expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                       min_new_tokens=10)[0, len(p):].tolist()
            assert f.result(60).output_ids == expected
        again = engine.generate(prompts[-1], params)  # now served from the prefix cache
        assert again.cached_tokens > 0
        assert again.output_ids == futures[-1].result().output_ids
    finally:
        engine.stop()
