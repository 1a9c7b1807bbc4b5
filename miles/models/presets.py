"""Tiny real models built locally: an HF Qwen3 (dense), Qwen3-MoE, DeepSeek-V3 (MLA, dense first
layers, sigmoid group-limited router, shared expert), GLM-4.5 MoE, GLM-5 (MLA + DSA indexer), MiniMax-M2, GPT-OSS, Qwen3-Next
and Qwen3.5-MoE's text model (gated delta-net hybrids), Nemotron-H (Mamba-2 hybrid), Qwen2.5-VL or Qwen3-VL config with small
dimensions and a byte-level BPE tokenizer trained with the `tokenizers` library, saved as an ordinary
checkpoint directory (a VL one with its image processor's preprocessor_config.json).

They stand in for large checkpoints in demos and tests and travel the same loading code.
Non-goal: quality. A preset is the smallest architecture that still exercises every code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from miles.data.tasks.arithmetic import ArithmeticTask, demonstration
from miles.models.vision import VISION_TOKENS

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen-VL's: a message's content is text or a list of parts; an image part renders as one placeholder
# between vision markers, which the processor then expands to the image's tokens.
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' or p['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A little general text so the tokenizer covers ordinary words, not only arithmetic.
_GENERAL_TEXT = [
    "The trainer computes a policy update and the engines generate under the new weights.",
    "Run the command, read the output, and answer with the result.",
    "user assistant system tool observation reward answer question",
    "ls cat echo grep python file directory error exit status",
]


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 512
    vocab_size: int = 320
    num_experts: int = 0  # > 0 builds a Qwen3-MoE model: every decoder layer's MLP is a sparse MoE block
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    model_vocab_size: int = 0  # > 0: the embedding has this many rows, more than the tokenizer's (as Qwen3 pads)
    vision: VisionPreset | None = None  # set: a vision-language model (family qwen2_5_vl or qwen3_vl) with this tower
    family: str = "qwen3"  # the HF model type (FAMILIES); "qwen3" with num_experts builds Qwen3-MoE
    extra: dict = field(default_factory=dict)  # further config fields of that family (MLA ranks, groups, ...)


@dataclass(frozen=True)
class VisionPreset:
    depth: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    patch_size: int = 8      # pixels per patch side; with merge 2 one image token covers 16x16 pixels
    max_pixels: int = 64 * 64  # the image processor resizes larger images down to this (16 tokens)
    # Weight matrices of the tower drawn from N(0, init_std): at transformers' 0.02 a tower this small
    # passes images on so faintly that a tiny model does not learn to tell them apart within minutes.
    init_std: float = 0.1
    # Qwen3-VL: the tower blocks whose output also feeds the first decoder layers (one per layer, in order).
    deepstack: tuple[int, ...] = ()


PRESETS: dict[str, Preset] = {
    "tiny-qwen3": Preset(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # Wider, for examples that must learn a task within minutes on a CPU (about 3M parameters).
    "small-qwen3": Preset(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=32),
    # Mixture of experts (HF Qwen3-MoE): 8 experts, top-2 routing in each of the 4 layers.
    "tiny-qwen3-moe": Preset(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96),
    # Qwen3-0.6B's shape (596M parameters: 28 layers, GQA 16/8 heads of 128, vocabulary 151936, 40960
    # positions), randomly initialised, with the small local tokenizer: for timing GPU runs, not for tasks.
    "qwen3-0.6b-shape": Preset(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=40960, model_vocab_size=151936),
    # Qwen2.5-VL: tiny-qwen3's decoder with a 2-block vision tower; a 32x32 image is 4 image tokens,
    # images are resized to at most 64x64 (16 tokens). About 1M parameters.
    "tiny-qwen-vl": Preset(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=400,
                           vision=VisionPreset(), family="qwen2_5_vl"),
    # Qwen3-VL: the same decoder (Qwen3's, q/k norms) with interleaved multimodal rotary positions and
    # a 2-block tower whose blocks' outputs are also added, merged, into the first two decoder layers'
    # hidden states at the image tokens (deepstack). A 32x32 image is 4 image tokens, as above.
    "tiny-qwen3-vl": Preset(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=400,
                            vision=VisionPreset(deepstack=(0, 1)), family="qwen3_vl"),
    # DeepSeek-V3 / Kimi-K2 architecture: multi-head latent attention (KV compressed to a rank-32
    # latent plus a 16-wide rope part), the first layer dense, then 8 routed experts in 4 groups (top-2
    # groups, top-2 experts) chosen by sigmoid + correction bias, weights scaled by 2.5, one shared expert.
    # (head_dim is the rope part's width, as DeepSeek-V3's config defines it.)
    "tiny-deepseek-v3": Preset(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=64, family="deepseek_v3",
                               extra=dict(kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                          v_head_dim=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                                          n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    # tiny-deepseek-v3's architecture sized like small-qwen3, for examples that must learn a task within
    # minutes on a CPU (examples/moe_r3): MLA over 8 heads (queries through a rank-128 latent, keys and
    # values through a rank-64 one plus a 16-wide rope part), the first of 4 layers dense, then 8 routed
    # experts in 4 groups (top-2 groups, top-2 experts; sigmoid + correction bias), weights scaled by 2.5,
    # one shared expert. Each token runs 3 experts of width 192 (576 in all; small-qwen3's MLP is 768):
    # 5.5M parameters, 2.8M of them active per token.
    "small-deepseek-v3": Preset(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=8, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=192, family="deepseek_v3",
                                extra=dict(kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                           v_head_dim=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                                           n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    # GLM-4.5 MoE: GQA with half-rotary heads, the first layer dense, 8 experts (sigmoid + correction bias,
    # one group), one shared expert.
    "tiny-glm4-moe": Preset(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=64, family="glm4_moe",
                            extra=dict(n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                       routed_scaling_factor=2.5, norm_topk_prob=True)),
    # GLM-5 (glm_moe_dsa): DeepSeek-V3's MLA (rank-32 latent, 16-wide rope part) with DeepSeek sparse
    # attention: in each layer a lightning indexer (4 heads of 32) keeps the 4 best keys per query, so
    # prompts of a few tokens already attend to a subset; the third layer reuses the second's choice
    # ("shared", as GLM-5's later layers may). The first layer dense, then 8 experts (sigmoid +
    # correction bias, one group as GLM-5, weights scaled by 2.5) and a shared expert.
    "tiny-glm5": Preset(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=64, family="glm_moe_dsa",
                        extra=dict(kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                   v_head_dim=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                                   n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                   index_topk=4, index_n_heads=4, index_head_dim=32,
                                   indexer_types=["full", "full", "shared", "full"])),
    # MiniMax-M2: every layer MoE, 8 experts chosen by sigmoid + a correction bias kept on the MoE block.
    "tiny-minimax-m2": Preset(hidden_size=128, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                              family="minimax_m2"),
    # GPT-OSS: attention sinks, sliding-window layers (a window of 8 tokens, so short prompts cross it)
    # alternating with full ones, 8 experts weighed by a softmax over the chosen logits.
    "tiny-gpt-oss": Preset(hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, family="gpt_oss",
                           extra=dict(sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Qwen3-Next (the hybrid of Qwen3.5): three gated delta-net layers (a causal conv and a delta-rule
    # recurrent state per sequence, no KV) then one full-attention layer with gated output and a quarter
    # of each head rotary; every layer's MLP 8 experts (softmax top-2, renormalised) plus a gated shared expert.
    "tiny-qwen3-next": Preset(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=64, family="qwen3_next",
                              extra=dict(shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                                         norm_topk_prob=True,
                                         layer_types=["linear_attention"] * 3 + ["full_attention"],
                                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                                         linear_value_head_dim=32, linear_conv_kernel_dim=4)),
    # Qwen3.5-MoE's text model: Qwen3-Next's hybrid layout (three gated delta-net layers, then full
    # attention) with separate q/k/v, z, b, a projections and interleaved multimodal rotary positions
    # (text tokens take the same position on all three axes, so 2-D positions serve).
    "tiny-qwen3-5-moe": Preset(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=64, family="qwen3_5_moe_text",
                               extra=dict(shared_expert_intermediate_size=64,
                                          layer_types=["linear_attention"] * 3 + ["full_attention"],
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                                          linear_value_head_dim=32, linear_conv_kernel_dim=4,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                                           "mrope_interleaved": True})),
    # Nemotron-H: Mamba-2 blocks (a conv state and an SSM state per sequence) interleaved with one
    # attention block and MoE blocks of 8 experts (sigmoid + correction bias, scaled) with a shared expert.
    "tiny-nemotron-h": Preset(hidden_size=128, intermediate_size=256, num_hidden_layers=5, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=64, family="nemotron_h",
                              extra=dict(moe_shared_expert_intermediate_size=64, n_group=1, topk_group=1,
                                         routed_scaling_factor=2.0, norm_topk_prob=True,
                                         layers_block_type=["mamba", "moe", "attention", "mamba", "moe"],
                                         mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                                         conv_kernel=4, chunk_size=16)),
}

# HF model type -> (config class name in transformers, the config field holding the routed expert count).
FAMILIES = {
    "qwen3": ("Qwen3Config", None),
    "qwen3_moe": ("Qwen3MoeConfig", "num_experts"),
    "deepseek_v3": ("DeepseekV3Config", "n_routed_experts"),
    "glm4_moe": ("Glm4MoeConfig", "n_routed_experts"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "n_routed_experts"),
    "minimax_m2": ("MiniMaxM2Config", "num_local_experts"),
    "gpt_oss": ("GptOssConfig", "num_local_experts"),
    "qwen3_next": ("Qwen3NextConfig", "num_experts"),
    "nemotron_h": ("NemotronHConfig", "n_routed_experts"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "num_experts"),
}


def _corpus(seed: int) -> list[str]:
    task = ArithmeticTask(digits=3, split="train", seed=seed)
    return [demonstration(p) for p in task.take(2000)] + _GENERAL_TEXT * 20


def train_tokenizer(vocab_size: int, seed: int = 0, extra_special: tuple[str, ...] = ()):
    """Byte-level BPE with single-digit pre-tokenization (as Qwen does), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + list(extra_special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=512)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(preset: str, out: str | Path, seed: int = 0, init_std: float = 0.0) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json to `out`.

    `init_std` > 0 redraws every weight matrix from N(0, init_std). The default init (std 0.02) gives
    near-uniform logits and router scores; larger weights give varied outputs and routing decisions
    that matter, for tests and benchmarks that compare outputs or routing."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if p.vision is not None:
        return _build_vlm(p, out, seed, init_std)
    tokenizer = train_tokenizer(p.vocab_size, seed=seed)
    family = "qwen3_moe" if p.family == "qwen3" and p.num_experts else p.family
    config_class, experts_key = FAMILIES[family]
    moe = {}
    if p.num_experts:
        moe = {experts_key: p.num_experts, "num_experts_per_tok": p.num_experts_per_tok,
               "moe_intermediate_size": p.moe_intermediate_size}
        if family == "qwen3_moe":
            moe.update(decoder_sparse_step=1, norm_topk_prob=True)
        if family in ("minimax_m2", "gpt_oss"):  # experts intermediate_size wide; no moe_intermediate_size
            del moe["moe_intermediate_size"]
    config = getattr(transformers, config_class)(
        vocab_size=p.model_vocab_size or len(tokenizer), hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads, head_dim=p.head_dim,
        max_position_embeddings=p.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rope_theta=10000.0, dtype="float32", **moe, **p.extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if init_std > 0:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:  # projections, embeddings, stacked experts, routers; not norms
                    param.normal_(0.0, init_std)
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    # A correction bias that changes which experts are chosen (it never weighs them):
                    # trained routers carry one, and R3 must replay choices it made.
                    buf.normal_(0.0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _build_vlm(p: Preset, out: Path, seed: int, init_std: float) -> Path:
    """A Qwen2.5-VL or Qwen3-VL checkpoint: config, weights, tokenizer (with the vision tokens) and image
    processor (the processor's video half needs torchvision, which miles does not serve)."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    v = p.vision
    tokenizer = train_tokenizer(p.vocab_size, seed=seed, extra_special=tuple(VISION_TOKENS))
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos = tokenizer.eos_token_id
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    if p.family == "qwen3_vl":
        model = _qwen3_vl(p, len(tokenizer), tokens, seed)
        # Qwen3-VL's checkpoints normalise pixels to [-1, 1] (mean = std = 0.5), not with CLIP's statistics.
        norm = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    else:
        model = _qwen2_5_vl(p, len(tokenizer), tokens, seed)
        norm = {}
    with torch.no_grad():
        for param in model.model.visual.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, v.init_std)
    if init_std > 0:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, init_std)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=v.patch_size, merge_size=2, temporal_patch_size=2,
                             min_pixels=(2 * v.patch_size) ** 2, max_pixels=v.max_pixels, **norm).save_pretrained(out)
    return out


def _qwen3_vl(p: Preset, vocab_size: int, tokens: dict, seed: int):
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    v = p.vision
    # Interleaved mrope: frequency i turns with h (i % 3 == 1) or w (i % 3 == 2) up to 3 x their sections,
    # with t elsewhere; so h and w take at most a third each (Qwen3-VL: [24, 20, 20] of 64).
    half, hw = p.head_dim // 2, p.head_dim * 5 // 32
    text = dict(vocab_size=vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
                num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
                num_key_value_heads=p.num_key_value_heads, head_dim=p.head_dim,
                max_position_embeddings=p.max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                 "mrope_section": [half - 2 * hw, hw, hw]},
                tie_word_embeddings=True, bos_token_id=tokens["bos_token_id"], eos_token_id=tokens["eos_token_id"],
                pad_token_id=tokens["pad_token_id"])
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_heads=v.num_heads, out_hidden_size=p.hidden_size, patch_size=v.patch_size,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=list(v.deepstack))
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config)


def _qwen2_5_vl(p: Preset, vocab_size: int, tokens: dict, seed: int):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    v = p.vision
    eos = tokens["eos_token_id"]
    half = p.head_dim // 2  # mrope splits each head's rotary frequencies over (t, h, w)
    text = dict(vocab_size=vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
                num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
                num_key_value_heads=p.num_key_value_heads, max_position_embeddings=p.max_position_embeddings,
                rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": [half - 2 * (half * 3 // 8),
                                                                                    half * 3 // 8, half * 3 // 8]},
                tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=tokens["pad_token_id"])
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_heads=v.num_heads, out_hidden_size=p.hidden_size, patch_size=v.patch_size,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=4 * v.patch_size,
                  fullatt_block_indexes=[v.depth - 1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)
