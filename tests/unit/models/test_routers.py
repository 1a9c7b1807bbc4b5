"""Router families (models/routers.py) against transformers' own router modules: the gate weights
miles computes for a set of expert ids are the ones the model's router returns for those ids, for
every family it knows; the MoE layers it counts are the ones the model builds; a router it does not
know is refused with its class named."""

from __future__ import annotations

import pytest
import torch

from miles.models.moe import model_routers, moe_layers, moe_shape
from miles.models.routers import UnknownRouter
from tests.helpers.moe_families import CONFIGS, tiny_config, tiny_moe

FAMILIES = sorted(CONFIGS)


def router_outputs(model, tokens: int = 24):
    """[(router, router inputs, (logits, weights, ids))] of one forward over random tokens."""
    seen = []
    rs = model_routers(model)
    handles = [r.module.register_forward_hook(lambda _m, args, out, r=r: seen.append((r, args, out))) for r in rs]
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(2, 96, (2, tokens // 2), generator=torch.Generator().manual_seed(0)))
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == len(rs)
    return seen


@pytest.mark.parametrize("model_type", FAMILIES)
def test_moe_layers_are_the_layers_the_model_builds_a_router_in(model_type):
    model = tiny_moe(model_type)
    found = [int(r.name.split(".")[2]) for r in model_routers(model)]
    assert found == moe_layers(model.config) and moe_shape(model.config) == (len(found), 2)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_weights_for_the_routers_own_choice_are_the_routers_weights(model_type):
    for router, _args, (logits, weights, ids) in router_outputs(tiny_moe(model_type)):
        mine = router.family.weights(logits, ids, weights.dtype)
        assert mine.dtype == weights.dtype
        assert (mine - weights).abs().max() <= 1e-7, router.name


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe", "glm_moe_dsa", "minimax_m2", "nemotron_h"])
def test_replayed_ids_get_the_weights_the_router_gives_when_it_chooses_them(model_type):
    """Sigmoid routers choose by score + correction bias but weigh by score alone: a bias that forces
    two experts on every token makes the router itself weigh those experts, which replaying them must
    reproduce although the router, unforced, would have chosen others."""
    model = tiny_moe(model_type)
    free = router_outputs(model)
    forced_ids = torch.tensor([0, 3])  # within the groups every family here may choose together
    for r in model_routers(model):
        owner = r.module if hasattr(r.module, "e_score_correction_bias") else \
            model.get_submodule(r.name.rsplit(".", 1)[0])  # MiniMax-M2 keeps the bias on the MoE block
        owner.e_score_correction_bias.fill_(0.0)[forced_ids] = 100.0
    changed = 0
    for (router, args, (logits, weights, ids)), (_, _, (_, _, free_ids)) in zip(router_outputs(model), free):
        assert torch.equal(ids.sort(-1).values, forced_ids.expand_as(ids))
        changed += int((free_ids.sort(-1).values != ids.sort(-1).values).any(-1).sum())
        assert (router.family.weights(logits, ids, weights.dtype) - weights).abs().max() <= 1e-7
    assert changed > 0  # the forced choice differs from the free one for some tokens


def test_softmax_over_all_experts_is_not_what_sigmoid_routers_weigh_by():
    """The replay miles did before router families (softmax over the logits, renormalised) is off by
    far more than numerics for a DeepSeek-style router: why an unknown router is refused, not guessed."""
    for router, _args, (logits, weights, ids) in router_outputs(tiny_moe("deepseek_v3")):
        guess = torch.softmax(logits, -1).gather(1, ids)
        guess = guess / guess.sum(-1, keepdim=True)
        assert (guess - weights).abs().max() > 0.5


def test_a_router_of_unknown_family_is_refused_with_its_class_named():
    from transformers import AutoModelForCausalLM, PhimoeConfig

    model = AutoModelForCausalLM.from_config(PhimoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    assert moe_shape(model.config) == (2, 2)
    with pytest.raises(UnknownRouter, match="router class PhimoeTopKRouter.*never replay.*return_routed_experts = false"):
        model_routers(model)


def test_a_dense_model_has_no_moe_layers():
    assert moe_shape(tiny_config("deepseek_v3", first_k_dense_replace=3)) is None
    assert moe_layers(tiny_config("qwen3_moe", mlp_only_layers=[0, 1, 2])) == []
