"""Hugging Face checkpoints in Megatron's layout and back: the model's shape as a TransformerConfig,
and each weight between HF's names and Megatron's (fused, sharded) parameters.

Written in the project rather than through mbridge: mbridge 0.15.1 names TransformerEngine's layers
(a CPU run has the local pure-torch layers), reads `rope_theta` where transformers 5 no longer keeps
it, and splits pure-torch experts over tensor parallelism wrongly; what the three families the
presets build need (Qwen3 dense, Qwen3-MoE, Llama) is the table below.

Layouts, per decoder layer (G query groups of h heads, d = head_dim, TP ranks t):
- `linear_qkv` fuses q, k and v group by group: [q(g) (h·d rows), k(g) (d), v(g) (d)] for g in 0..G-1,
  so each TP rank's contiguous slice holds whole groups;
- `linear_fc1` holds [gate; up] per TP shard, so the full tensor is the shards' [gate_r; up_r] in rank order;
- experts: local expert j of expert-parallel rank e is global expert e·E_local + j; HF keeps them
  stacked (`gate_up_proj` (E, 2I, H) = [gate; up], `down_proj` (E, H, I)).
Every other weight is HF's own tensor, sharded along the dimension megatron-core marks
(`partition_dim`) or whole. The conversion is a permutation of rows: HF → Megatron → HF is bit-exact.

Non-goal: multimodal models (refused), distributing the tensors (backend.py gathers and scatters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from miles.trainer.backends.megatron import FAMILIES


def check_family(hf_config) -> None:
    if hf_config.model_type not in FAMILIES:
        raise ValueError(f"trainer.backend = 'megatron' converts {', '.join(FAMILIES)} checkpoints; "
                         f"{hf_config.model_type!r} is not one of them: use trainer.backend = 'fsdp'")


def rope_theta(hf_config) -> float:
    """transformers 5 keeps it in `rope_parameters`; earlier releases as `rope_theta`."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"trainer.backend = 'megatron' supports plain RoPE; this checkpoint's rope_type is "
                         f"{params['rope_type']!r}: use trainer.backend = 'fsdp'")
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def is_moe(hf_config) -> bool:
    return getattr(hf_config, "num_experts", 0) > 0 or getattr(hf_config, "num_local_experts", 0) > 1


def num_experts(hf_config) -> int:
    return getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0)


def transformer_config_kwargs(hf_config) -> dict:
    """The model's shape and numerics as TransformerConfig keywords (the parallel sizes are the caller's)."""
    check_family(hf_config)
    kw = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads, num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size, normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_layernorm=hf_config.model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0, attention_dropout=0.0,
        # Fusions are CUDA kernels; attention softmax in float32 as transformers' eager/sdpa paths do.
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=True,
    )
    if is_moe(hf_config):
        if list(getattr(hf_config, "mlp_only_layers", []) or []) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
            raise ValueError("trainer.backend = 'megatron' needs every decoder layer to be a MoE layer "
                             "(decoder_sparse_step = 1, no mlp_only_layers): use trainer.backend = 'fsdp'")
        kw.update(num_moe_experts=num_experts(hf_config), moe_router_topk=hf_config.num_experts_per_tok,
                  moe_ffn_hidden_size=hf_config.moe_intermediate_size, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0,
                  moe_router_dtype="fp32", moe_grouped_gemm=False,
                  # norm_topk_prob: softmax over the chosen k (= the top-k of the full softmax, renormalised);
                  # otherwise the full softmax's probabilities of the chosen k.
                  moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", True))
    return kw


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter (its name after `decoder.layers.{i}.`, or a top-level name) from HF tensors.
    `to_mcore` builds the full Megatron tensor (its TP shards concatenated along `partition_dim`) from
    the HF tensors; `to_hf` splits it back."""

    mcore: str
    hf: tuple[str, ...]
    to_mcore: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def _same(ts):
    return ts[0]


def _one(t):
    return [t]


def _qkv_rules(hf_config, prefix: str, suffix: str) -> Rule:
    G = hf_config.num_key_value_heads
    h = hf_config.num_attention_heads // G
    d = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads

    def fuse(ts):
        q, k, v = (t.reshape(-1, d, *t.shape[1:]) for t in ts)  # (heads, d, ...)
        q = q.reshape(G, h, d, *q.shape[2:])
        groups = [torch.cat([q[g].reshape(h * d, *q.shape[3:]), k[g], v[g]]) for g in range(G)]
        return torch.cat(groups)

    def split(t):
        per = t.reshape(G, (h + 2) * d, *t.shape[1:])
        q = per[:, :h * d].reshape(G * h * d, *t.shape[1:])
        k = per[:, h * d:(h + 1) * d].reshape(G * d, *t.shape[1:])
        v = per[:, (h + 1) * d:].reshape(G * d, *t.shape[1:])
        return [q.contiguous(), k.contiguous(), v.contiguous()]

    return Rule(f"self_attention.linear_qkv.{suffix}",
                tuple(f"{prefix}self_attn.{p}_proj.{suffix}" for p in "qkv"), fuse, split)


def gate_up_rule(mcore: str, hf: tuple[str, ...], tp: int, stacked: bool = False) -> Rule:
    """[gate; up] per TP shard. HF gives them apart (dense) or stacked as one [gate; up] (experts)."""

    def fuse(ts):
        gate, up = ts if not stacked else ts[0].chunk(2)
        return torch.cat([x for r in range(tp) for x in (gate.chunk(tp)[r], up.chunk(tp)[r])])

    def split(t):
        shards = [s.chunk(2) for s in t.chunk(tp)]
        gate, up = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])
        return [torch.cat([gate, up])] if stacked else [gate, up]

    return Rule(mcore, hf, fuse, split)


def layer_rules(hf_config, i: int, tp: int) -> list[Rule]:
    """Rules of decoder layer `i` (its experts apart: `expert_rules`)."""
    p = f"model.layers.{i}."
    rules = [
        Rule("input_layernorm.weight", (p + "input_layernorm.weight",), _same, _one),
        _qkv_rules(hf_config, p, "weight"),
        Rule("self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",), _same, _one),
        Rule("pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",), _same, _one),
    ]
    if transformer_config_kwargs(hf_config)["add_qkv_bias"]:
        rules.append(_qkv_rules(hf_config, p, "bias"))
    if hf_config.model_type in ("qwen3", "qwen3_moe"):
        rules += [Rule("self_attention.q_layernorm.weight", (p + "self_attn.q_norm.weight",), _same, _one),
                  Rule("self_attention.k_layernorm.weight", (p + "self_attn.k_norm.weight",), _same, _one)]
    if is_moe(hf_config):
        rules.append(Rule("mlp.router.weight", (p + "mlp.gate.weight",), _same, _one))
    else:
        rules += [gate_up_rule("mlp.linear_fc1.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), tp),
                  Rule("mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), _same, _one)]
    return rules


def expert_names(i: int) -> tuple[str, str]:
    """HF's stacked expert tensors of layer `i`: [gate; up] (E, 2I, H) and down (E, H, I)."""
    return f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"


def top_rules(hf_config) -> list[Rule]:
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), _same, _one),
             Rule("decoder.final_layernorm.weight", ("model.norm.weight",), _same, _one)]
    if not hf_config.tie_word_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), _same, _one))
    return rules
