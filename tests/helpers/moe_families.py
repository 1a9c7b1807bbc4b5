"""Tiny HF mixture-of-experts models of every router family miles knows, built from configs with
transformers' own classes (no downloads), with random weights large enough that routing varies and a
random score-correction bias where the family has one (it changes choices, never weights)."""

from __future__ import annotations

import torch

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=1)

# model type -> (config class, its fields beyond _COMMON). 8 experts, top-2 in each.
CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                         norm_topk_prob=False, head_dim=8, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8)),
    "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                             num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=4,
                                             topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                                             routed_scaling_factor=2.5, norm_topk_prob=True)),
    "glm4_moe": ("Glm4MoeConfig", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                                       n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                       routed_scaling_factor=1.5, norm_topk_prob=True)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16,
                                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2,
                                            topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                            routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=4,
                                            index_n_heads=2, index_head_dim=16)),
    "minimax_m2": ("MiniMaxM2Config", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                                           intermediate_size=16)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8, sliding_window=16,
                                     intermediate_size=16)),
    "qwen3_next": ("Qwen3NextConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                           shared_expert_intermediate_size=16, head_dim=8, decoder_sparse_step=1,
                                           mlp_only_layers=[0], layer_types=["linear_attention", "linear_attention",
                                                                             "full_attention"],
                                           linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                                           linear_value_head_dim=8)),
    "nemotron_h": ("NemotronHConfig", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                           moe_shared_expert_intermediate_size=16, head_dim=8, n_group=1,
                                           topk_group=1, routed_scaling_factor=2.0, norm_topk_prob=True,
                                           layers_block_type=["mamba", "moe", "attention"], mamba_num_heads=4,
                                           mamba_head_dim=8, ssm_state_size=8, n_groups=1)),
}


def tiny_config(model_type: str, **overrides):
    import transformers

    cls, fields = CONFIGS[model_type]
    return getattr(transformers, cls)(**{**_COMMON, **fields, **overrides})


def tiny_moe(model_type: str, seed: int = 0, **overrides):
    """A float32 model of `model_type` in eval mode, with N(0, 0.1) weight matrices."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return model
