"""Every algorithm against small hand-computed cases: advantages, per-token losses, aggregation."""

import math

import pytest
import torch

from miles.trainer.algorithms import ALGORITHMS, get_algorithm
from miles.trainer.algorithms.base import (AlgorithmConfig, LossInputs, clipped_surrogate, entropy_from_logits,
                                           kl_estimate, kl_reward_penalty, token_weights)
from miles.trainer.critic import gae, value_loss


def algo(name, **kw):
    return get_algorithm(AlgorithmConfig(name=name, **kw))


def inputs(logp, old, adv, mask=None, seq_ids=None):
    t = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
    mask = t(mask) if mask is not None else torch.ones(1, len(logp))
    sid = torch.tensor([seq_ids]) if seq_ids is not None else torch.zeros(1, len(logp), dtype=torch.long)
    return LossInputs(t(logp), t(old), t(adv), mask, sid)


def test_dr_grpo_centres_without_std_and_sums_over_a_constant():
    dr = algo("dr_grpo")
    assert dr.advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert dr.loss_agg == "seq_mean_token_sum_norm"
    # Two sequences of 2 and 4 loss tokens, constant 8: every token weighs 1 / (8 × 2).
    assert token_weights("seq_mean_token_sum_norm", [2, 4], 6, 2, 8) == [1 / 16, 1 / 16]


def test_seq_mean_token_mean_and_token_mean_weights():
    assert token_weights("seq_mean_token_mean", [2, 4], 6, 2, 0) == [1 / 4, 1 / 8]
    assert token_weights("token_mean", [2, 4], 6, 2, 0) == [1 / 6, 1 / 6]


def test_dapo_clips_higher_than_lower():
    dapo = algo("dapo")
    assert (dapo.clip_low, dapo.clip_high) == (0.2, 0.28)
    # ratio 1.25 with A > 0 is inside DAPO's range (GRPO would clip it to 1.2).
    x = inputs([math.log(1.25), math.log(1.5)], [0.0, 0.0], [1.0, 1.0])
    loss, extra = dapo.token_loss(x)
    assert loss[0].tolist() == pytest.approx([-1.25, -1.28], abs=1e-6)
    assert extra["clipfrac"][0].tolist() == [0.0, 1.0]
    assert dapo.loss_agg == "token_mean"


def test_gspo_uses_one_ratio_per_sequence():
    gspo = algo("gspo", clip_eps_low=0.5, clip_eps_high=0.5)
    # Sequence 0: log-ratios 0.2 and 0.0 → mean 0.1 → ratio e^0.1 on both tokens; sequence 1: log 1.0 = 0.
    x = inputs([0.2, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, -2.0], seq_ids=[0, 0, 1])
    loss, _ = gspo.token_loss(x)
    r = math.exp(0.1)
    assert loss[0].tolist() == pytest.approx([-r, -r, 2.0], abs=1e-6)
    assert gspo.loss_agg == "seq_mean_token_mean"
    assert (algo("gspo").clip_low, algo("gspo").clip_high) == (3e-4, 4e-4)


def test_gspo_sequence_ratio_clips_as_a_whole():
    gspo = algo("gspo")
    x = inputs([0.5, 0.5], [0.0, 0.0], [1.0, 1.0], seq_ids=[0, 0])
    loss, extra = gspo.token_loss(x)
    assert loss[0].tolist() == pytest.approx([-(1 + 4e-4)] * 2, abs=1e-6)
    assert extra["clipfrac"][0].tolist() == [1.0, 1.0]


def test_reinforce_pp_whitens_over_the_global_batch():
    rpp = algo("reinforce_pp")
    assert rpp.advantages([1.0, 0.0]) == [1.0, 0.0]  # no per-group baseline
    # Batch rewards 1, 0, 0, 0: mean 0.25, std sqrt(3)/4.
    out = rpp.batch_advantages([1.0, 0.0, 0.0, 0.0])
    s = math.sqrt(3) / 4
    assert out == pytest.approx([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], abs=1e-4)


def test_reinforce_pp_baseline_subtracts_group_mean_then_divides_by_batch_std():
    rpb = algo("reinforce_pp_baseline")
    g1, g2 = rpb.advantages([1.0, 0.0]), rpb.advantages([3.0, 3.0])
    assert g1 == [0.5, -0.5] and g2 == [0.0, 0.0]
    out = rpb.batch_advantages(g1 + g2)  # population std of [.5, -.5, 0, 0] = sqrt(0.125)
    assert out == pytest.approx([0.5 / math.sqrt(0.125), -0.5 / math.sqrt(0.125), 0.0, 0.0], abs=1e-4)


def test_rloo_leave_one_out_baseline():
    # r = [1, 0, 0]: baselines 0, 0.5, 0.5.
    assert algo("rloo").advantages([1.0, 0.0, 0.0]) == pytest.approx([1.0, -0.5, -0.5])
    assert algo("rloo").advantages([2.0]) == [0.0]


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    # ratio 5 with A = -1: plain PPO loss is max(5, 0.8)·1 = 5; dual-clip with c = 3 caps it at 3.
    loss, clipped = clipped_surrogate(torch.tensor([math.log(5.0)]), torch.zeros(1), torch.tensor([-1.0]),
                                      0.2, 0.2, dual_clip_c=3.0)
    assert loss.tolist() == pytest.approx([3.0])
    assert clipped.tolist() == [1.0]
    plain, _ = clipped_surrogate(torch.tensor([math.log(5.0)]), torch.zeros(1), torch.tensor([-1.0]), 0.2, 0.2)
    assert plain.tolist() == pytest.approx([5.0])
    # Positive advantages are untouched by dual-clip.
    pos, _ = clipped_surrogate(torch.tensor([math.log(5.0)]), torch.zeros(1), torch.tensor([1.0]), 0.2, 0.2, 3.0)
    assert pos.tolist() == pytest.approx([-1.2])


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # log r = log(ref/policy) = log 0.5
    lr = math.log(0.5)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-lr)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * lr * lr)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 - lr)
    assert kl_estimate(ref, ref, "k3").item() == 0.0


def test_kl_reward_penalty_sums_kl_to_the_end_of_each_sequence():
    # Two packed sequences in one row: tokens 0-1 (seq 0) and 2-3 (seq 1); k1 KL per token 0.1..0.4.
    logp = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    ref = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    out = kl_reward_penalty(adv, logp, ref, mask, torch.tensor([[0, 0, 1, 1]]), coef=1.0)
    assert out[0].tolist() == pytest.approx([1 - 0.3, 1 - 0.2, -1 - 0.7, -1 - 0.4], abs=1e-6)


def test_gae_by_hand():
    # One sequence of 3 loss tokens, reward 1 at the end, values 0.5 each, gamma 1, lambda 0.5.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # deltas: 0, 0, 0.5; A2 = 0.5, A1 = 0 + 0.5·0.5 = 0.25, A0 = 0.125
    assert adv[0].tolist() == pytest.approx([0.125, 0.25, 0.5, 0.0])
    assert ret[0].tolist() == pytest.approx([0.625, 0.75, 1.0, 0.0])


def test_value_loss_clip():
    v, old, ret = torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1.0])
    # Unclipped error 0; clipped value 0.2 → error 0.64; PPO takes the max.
    assert value_loss(v, old, ret, clip=0.2).tolist() == pytest.approx([0.32])
    assert value_loss(v, old, ret, clip=0.0).tolist() == pytest.approx([0.0])


def test_ppo_passes_rewards_to_gae_and_needs_a_critic():
    ppo = algo("ppo")
    assert ppo.needs_critic and ppo.advantages([1.0, 0.0]) == [1.0, 0.0]


def test_sft_loss_is_negative_log_likelihood():
    x = inputs([math.log(0.5), math.log(0.25)], [0.0, 0.0], [0.0, 0.0])
    loss, _ = algo("sft").token_loss(x)
    assert loss[0].tolist() == pytest.approx([math.log(2), math.log(4)])


def test_every_algorithm_is_registered_and_has_a_config_default():
    assert set(ALGORITHMS) == {"grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp", "reinforce_pp_baseline",
                               "rloo", "ppo", "sft", "decoupled_ppo", "seq_mis", "opd"}
    for name in ALGORITHMS:
        a = algo(name)
        assert a.loss_agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def test_entropy_bonus_term():
    # Uniform over 4 tokens: entropy log 4; one certain token: entropy 0.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1e4, -1e4, -1e4]])
    assert entropy_from_logits(logits).tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)
    # p = (0.5, 0.25, 0.25): H = 0.5 log 2 + 2 · 0.25 log 4 = 1.5 log 2
    three = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert entropy_from_logits(three).item() == pytest.approx(1.5 * math.log(2), abs=1e-6)


def test_every_algorithm_answers_the_capability_flags_the_trainer_reads():
    flags = ("needs_critic", "on_rollouts", "needs_teacher", "group_relative", "needs_reference", "needs_entropy",
             "corrects_off_policy", "needs_proximal", "reweights_groups")
    for name in ALGORITHMS.names():
        a = algo(name)
        assert all(isinstance(getattr(a, f), bool) for f in flags) and isinstance(a.teacher_path, str), name
    assert [n for n in ALGORITHMS.names() if not algo(n).group_relative] == ["opd", "ppo", "reinforce_pp", "sft"]
    assert algo("opd").needs_teacher and not algo("grpo").needs_teacher and not algo("grpo").reweights_groups
    with pytest.raises(NotImplementedError, match="reweighted_advantages"):
        algo("grpo").reweighted_advantages([1.0, 0.0], [0.0, 0.0])
