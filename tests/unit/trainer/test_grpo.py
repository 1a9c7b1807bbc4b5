"""GRPO against small hand-computed cases."""

import math

import pytest
import torch

from miles.trainer.algorithms import get_algorithm
from miles.trainer.algorithms.base import AlgorithmConfig, LossInputs
from miles.trainer.algorithms.grpo import GRPO


def test_group_normalised_advantages():
    grpo = get_algorithm(AlgorithmConfig())
    adv = grpo.advantages([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, population std 0.5 → ±1
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert get_algorithm(GRPO.Config(std_normalize=False)).advantages([3.0, 1.0]) == [1.0, -1.0]
    assert grpo.advantages([0.5, 0.5]) == [0.0, 0.0]


def test_clipped_token_loss():
    grpo = get_algorithm(AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.2))
    old = torch.zeros(3)
    logp = torch.tensor([math.log(1.5), math.log(1.1), math.log(0.5)])
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, extra = grpo.token_loss(LossInputs(logp, old, adv, torch.ones(3), torch.zeros(3, dtype=torch.long)))
    # ratio 1.5 with A>0 clips to 1.2; 1.1 is inside; 0.5 with A<0 clips to 0.8 → -min(-0.5, -0.8) = 0.8
    assert loss.tolist() == pytest.approx([-1.2, -1.1, 0.8], abs=1e-6)
    assert extra["clipfrac"].tolist() == [1.0, 0.0, 1.0]


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        get_algorithm(AlgorithmConfig(name="nope"))


def _sample(reward: float, status, n: int = 3):
    from miles.buffer.types import Sample

    return Sample(prompt_ids=[1, 2], response_ids=[5] * n, rollout_logprobs=[-0.1] * n, loss_mask=[1] * n,
                  reward=reward, status=status)


def test_mask_truncated_drops_a_cut_off_samples_loss_tokens_but_keeps_its_reward_in_the_baseline():
    from miles.buffer.types import Group, SampleStatus
    from miles.trainer.batching import prepare_global_batch, sequences_from_groups

    group = Group(samples=[_sample(1.0, SampleStatus.COMPLETED), _sample(0.0, SampleStatus.TRUNCATED, 4),
                           _sample(0.0, SampleStatus.COMPLETED), _sample(1.0, SampleStatus.COMPLETED)])
    plain = sequences_from_groups([group], get_algorithm(AlgorithmConfig()))
    masked = sequences_from_groups([group], get_algorithm(AlgorithmConfig(mask_truncated=True)))
    assert [s.loss_mask for s in plain][1] == [1, 1, 1, 1]  # off by default
    assert [s.loss_mask for s in masked] == [[1, 1, 1], [0, 0, 0, 0], [1, 1, 1], [1, 1, 1]]
    # The truncated sample's 0 still enters the group's mean and std: the advantages are unchanged.
    assert [s.advantage for s in masked] == [s.advantage for s in plain] == pytest.approx([1, -1, -1, 1], abs=1e-5)
    _, totals = prepare_global_batch(masked, get_algorithm(AlgorithmConfig(mask_truncated=True)))
    assert (totals.loss_tokens, totals.num_seqs) == (9, 3)  # nor does it count in the loss's denominators
