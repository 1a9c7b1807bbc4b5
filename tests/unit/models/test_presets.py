"""The tiny preset is an ordinary HF checkpoint: transformers' Auto classes load it unchanged."""

import json
from pathlib import Path

import torch


def test_tiny_qwen3_round_trips_through_transformers(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = Path(tiny_model_dir)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (d / f).is_file(), f
    assert json.loads((d / "config.json").read_text())["model_type"] == "qwen3"

    model = AutoModelForCausalLM.from_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    ids = tok("47+38=85", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids) == list("47+38=85")  # digits one per token
    assert tok.decode(tok("tool output: ls -la").input_ids) == "tool output: ls -la"

    model.save_pretrained(tmp_path / "copy")
    tok.save_pretrained(tmp_path / "copy")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(x).logits, again(x).logits)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_loader_names_the_fix_for_a_missing_directory(tmp_path):
    import pytest

    from miles.models.loading import load_model

    with pytest.raises(FileNotFoundError, match="miles init-model"):
        load_model(str(tmp_path / "nowhere"))


def test_tiny_qwen3_vl_loads_as_transformers_qwen3_vl_with_deepstack_and_its_image_processor(tiny_qwen3_vl_model_dir):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from miles.models.vision import VISION_TOKENS, VisionProcessor
    from tests.helpers.images import png

    config = json.loads((Path(tiny_qwen3_vl_model_dir) / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    rope = config["text_config"]["rope_parameters"]
    half = config["text_config"]["head_dim"] // 2
    # Interleaved: h and w each turn at most a third of the frequencies, t the rest.
    assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) == half and 3 * rope["mrope_section"][1] <= half
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_model_dir)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert len(model.model.visual.deepstack_merger_list) == 2
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_vl_model_dir)
    assert [config[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")] == \
        tok.convert_tokens_to_ids(VISION_TOKENS)
    assert list(AutoImageProcessor.from_pretrained(tiny_qwen3_vl_model_dir).image_mean) == [0.5] * 3  # Qwen3-VL's
    assert VisionProcessor(tiny_qwen3_vl_model_dir).process(png("red")).num_tokens(2) == 4  # 32x32 pixels


def test_small_deepseek_v3_is_deepseek_v3_with_a_replayable_router(tmp_path):
    """The preset examples/moe_r3 learns on: DeepSeek-V3's architecture (MLA, a dense first layer,
    group-limited sigmoid routing with a shared expert, routed scaling), whose routers R3 weighs as the
    model does."""
    from transformers import AutoModelForCausalLM

    from miles.models.moe import model_routers, moe_layers, moe_shape, replay_refusal
    from miles.models.presets import build_tiny_model
    from miles.models.routers import RouterFamily

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model("small-deepseek-v3", tmp_path))
    c = model.config
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert (c.kv_lora_rank, c.q_lora_rank, c.first_k_dense_replace, c.n_shared_experts) == (64, 128, 1, 1)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (8, 2, 4, 2)
    assert moe_layers(c) == [1, 2, 3] and moe_shape(c) == (3, 2) and replay_refusal(c) is None
    routers = model_routers(model)
    assert [r.name for r in routers] == [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]
    assert {r.family for r in routers} == {RouterFamily("sigmoid", renormalize=True, scaling=2.5, eps=1e-20)}
    assert 5e6 < sum(p.numel() for p in model.parameters()) < 6e6
