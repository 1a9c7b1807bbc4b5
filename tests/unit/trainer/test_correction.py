"""Off-policy correction: truncated and masked importance weights, and their metrics."""

import math

import torch

from miles.trainer.algorithms.base import LossInputs, clipped_surrogate
from miles.trainer.correction import corrected_inputs, importance_weights, tis_metrics, tis_sums


def test_truncate_caps_the_weight_and_mask_zeroes_tokens_outside_the_band():
    train = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))
    rollout = torch.log(torch.tensor([[0.1, 0.5, 0.4]]))  # ratios 3, 1, 0.5
    w, changed = importance_weights(train, rollout, "truncate", 0.0, 2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.5]]))
    assert changed.tolist() == [[1.0, 0.0, 0.0]]
    w, _ = importance_weights(train, rollout, "mask", 0.8, 2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.0]]))


def test_weighted_loss_gradient_is_the_policy_gradient_scaled_by_the_weight():
    logits = torch.tensor([[0.0, 0.0]], requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :1].expand(1, 2).contiguous()  # (1, 2): one logprob, twice
    rollout = torch.tensor([[math.log(0.25), math.log(0.5)]])   # ratio 2 and 1 at π_train = 0.5
    adv = torch.ones(1, 2)
    x = LossInputs(logp, rollout, adv, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long))
    x2, w, _ = corrected_inputs(x, "mask", 0.0, 1.5)
    loss, _ = clipped_surrogate(x2.logprobs, x2.old_logprobs, x2.advantages, 0.2, 0.2)
    (loss * w).sum().backward()
    # Only the in-band token (weight 1) contributes: -∂log π(a0)/∂logits = -(1 - π, -π) = (-0.5, 0.5).
    assert torch.allclose(logits.grad, torch.tensor([[-0.5, 0.5]]))


def test_ess_is_one_for_equal_weights_and_drops_when_weights_spread():
    mask = torch.ones(1, 4)
    same = torch.zeros(1, 4)
    w, ch = importance_weights(same, same, "truncate", 0.0, 2.0)
    m = tis_metrics(tis_sums(w, ch, same, same, mask), 4)
    assert m["train/tis_ess"] == 1.0 and m["train/train_rollout_logprob_gap"] == 0.0
    spread = torch.log(torch.tensor([[1.9, 0.1, 0.1, 0.1]]))
    w, ch = importance_weights(spread, torch.zeros(1, 4), "truncate", 0.0, 2.0)
    m = tis_metrics(tis_sums(w, ch, spread, torch.zeros(1, 4), mask), 4)
    assert m["train/tis_ess"] < 0.5 and m["train/train_rollout_logprob_gap"] < 0


def test_bad_band_names_the_fix():
    import pytest

    from miles.config import ConfigError
    from miles.trainer.algorithms.base import AlgorithmConfig

    with pytest.raises(ConfigError, match="tis_clip_low < tis_clip_high"):
        AlgorithmConfig(tis_mode="truncate", tis_clip_low=2.0, tis_clip_high=1.0).validate()
