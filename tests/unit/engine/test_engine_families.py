"""The model families users post-train, served by the built-in engine: each tiny preset's greedy ids
equal transformers' own full-forward greedy, with logprobs within 1e-5 (float32), batched at mixed
lengths, and a prompt served again from the prefix cache gives identical outputs. GPT-OSS's window
(8 tokens) is shorter than the sequences, so its sliding layers are tested, sinks included (eager
attention, chosen per model). GLM-5's indexer keeps 4 keys per query, fewer than the sequences
hold, so its sparse attention is tested, with its indexer keys cached beside the MLA latent and
read back from the prefix cache. Layer kinds the engine cannot hold (DeepSeek-V3.2's DSA indexer;
recurrent layers of a family whose padding it has not checked) are refused with the kind named. The hybrid families it
does hold (Qwen3-Next, Nemotron-H) are tested in test_engine_recurrent.py."""

from __future__ import annotations

import pytest
import torch

SERVED = ["tiny-deepseek-v3", "tiny-glm4-moe", "tiny-glm5", "tiny-minimax-m2", "tiny-gpt-oss"]


def full_forward_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy ids and their logprobs, each step one forward over the whole sequence (no KV cache)."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            lp = model(input_ids=torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            ids.append(int(lp.argmax()))
            logprobs.append(float(lp[ids[-1]]))
    return ids[len(prompt):], logprobs


@pytest.mark.parametrize("preset", SERVED)
def test_preset_greedy_and_logprobs_match_transformers_and_the_prefix_cache(preset, preset_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.engine import Engine
    from miles.engine_api.sampling import SamplingParams
    from miles.models.loading import load_model

    path = preset_dir(preset)
    hf = load_model(path).eval()
    engine = Engine(EngineConfig(model_path=path, prefix_block_size=4))
    try:
        prompts = [list(range(3, 3 + n)) for n in (9, 14, 5)] + [list(range(3, 12)) + [40, 41]]
        params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
        futures = [engine.submit(engine.make_request(p, params, return_logprob=True)) for p in prompts]
        for p, f in zip(prompts, futures):
            out = f.result(120)
            ids, logprobs = full_forward_greedy(hf, p, 10)
            assert out.output_ids == ids
            assert max(abs(a - b) for a, b in zip(out.output_logprobs, logprobs)) <= 1e-5
        again = engine.generate(prompts[-1], params, return_logprob=True)  # its prefix is cached now
        first = futures[-1].result()
        assert again.cached_tokens > 0
        assert again.output_ids == first.output_ids
        # The cached prefix's KV came from another forward shape: the same values to float32 rounding.
        assert max(abs(a - b) for a, b in zip(again.output_logprobs, first.output_logprobs)) <= 1e-5
    finally:
        engine.stop()


def test_attention_implementation_is_chosen_per_model(preset_dir):
    from miles.models.loading import attention_implementation, load_model

    assert attention_implementation(preset_dir("tiny-deepseek-v3")) == "sdpa"
    assert attention_implementation(preset_dir("tiny-gpt-oss")) == "eager"  # sinks: transformers refuses sdpa
    assert load_model(preset_dir("tiny-gpt-oss")).config._attn_implementation == "eager"


def test_recurrent_layers_of_an_unchecked_family_are_refused_with_their_kind_named():
    from transformers import Lfm2Config

    from miles.engine.kv_cache import check_layout

    # LFM2's short-convolution layers: a conv state per sequence, padding behaviour not checked here.
    config = Lfm2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, layer_types=["conv", "conv", "full_attention"])
    with pytest.raises(NotImplementedError, match="layers \\[0, 1\\] of this 'lfm2' model are linear attention or "
                                                  "Mamba.*it batches qwen3_next, qwen3_5_moe_text, nemotron_h.*SGLang"):
        check_layout(config)


@pytest.mark.parametrize("model_type", ["qwen3_next", "nemotron_h"])
def test_hybrid_families_pass_the_layout_check(model_type):
    from miles.engine.kv_cache import check_layout
    from tests.helpers.moe_families import tiny_config

    check_layout(tiny_config(model_type))  # recurrent_state.py keeps their states per row


def test_dsa_layers_of_another_family_are_refused_with_their_kind_named():
    from transformers import DeepseekV32Config

    from miles.engine.kv_cache import check_layout

    # DeepSeek-V3.2's indexer rotates its keys differently from GLM-5's, whose indexer miles runs.
    config = DeepseekV32Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(NotImplementedError, match="'deepseek_v32'.*DSA indexed attention.*it serves glm_moe_dsa"):
        check_layout(config)
