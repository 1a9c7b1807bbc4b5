"""trainer.activation_checkpointing recomputes the decoder layers in the backward and changes no
gradient: the policy's gradients with and without it are equal."""

from __future__ import annotations

import torch

from miles.config.loader import build
from miles.trainer.backends.loading import load_policy
from miles.trainer.config import TrainerConfig
from miles.trainer.forward import forward_logprobs


def _grads(model_dir, checkpointing: bool) -> tuple[bool, dict[str, torch.Tensor]]:
    cfg = build(TrainerConfig, {"device": "cpu", "activation_checkpointing": checkpointing})
    model = load_policy(cfg, model_dir, torch.device("cpu")).train()
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    logp, _ = forward_logprobs(model, ids, torch.ones_like(ids))
    logp.sum().backward()
    return model.is_activation_checkpointing, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointed_gradients_equal_the_plain_ones(tiny_model_dir):
    on, with_ckpt = _grads(tiny_model_dir, True)
    off, plain = _grads(tiny_model_dir, False)
    assert on and not off
    for name, g in plain.items():
        torch.testing.assert_close(with_ckpt[name], g, atol=1e-6, rtol=1e-5, msg=name)
