"""The off-policy objectives for stale samples, on small hand-worked tensors: decoupled PPO's capped
behaviour weight around the proximal policy, sequence-level masked IS, their refusals, and their
metrics as a step reports them (trainer/loss.py)."""

import math

import pytest
import torch

from miles.config import ConfigError
from miles.config.loader import build
from miles.trainer.algorithms import AlgorithmConfig, get_algorithm
from miles.trainer.algorithms.base import LossInputs
from miles.trainer.batching import build_micro_batch
from miles.trainer.loss import ForwardOutputs, micro_batch_loss, step_metrics
from miles.trainer.types import TrainSequence


def algo(name, **kw):
    return get_algorithm(build(AlgorithmConfig, {"name": name, **kw}))


def log(values):
    return torch.log(torch.tensor([values], dtype=torch.float32))


def test_decoupled_ppo_weights_by_prox_over_behaviour_and_drops_tokens_over_the_cap():
    # π_θ = π_prox = (0.5, 0.4, 0.9), π_behav = (0.25, 0.4, 0.1): w = 2, 1, 9; the cap 5 drops the third.
    logits = log([0.5, 0.4, 0.9]).clone().requires_grad_(True)
    x = LossInputs(logits, log([0.25, 0.4, 0.1]), torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3),
                   torch.zeros(1, 3, dtype=torch.long))
    loss, m = algo("decoupled_ppo", behav_weight_cap=5.0, behav_kl_coef=0.0).token_loss(x)
    # AReaL's objective (no KL penalty): r = π_θ/π_prox = 1 in value, so loss = -w·A and ∂loss/∂log π_θ = -w·A.
    assert loss[0].tolist() == pytest.approx([-2.0, 1.0, 0.0], abs=1e-6)
    loss.sum().backward()
    assert logits.grad[0].tolist() == pytest.approx([-2.0, 1.0, 0.0], abs=1e-6)
    assert m["decoupled_ppo/clipped_frac_weight_cap"][0].tolist() == [0.0, 0.0, 1.0]
    assert m["decoupled_ppo/clipped_frac_ratio"][0].tolist() == [0.0, 0.0, 0.0]  # one update per batch: never binds
    assert m["decoupled_ppo/behav_weight_mean"][0].tolist() == pytest.approx([2.0, 1.0, 9.0], rel=1e-5)
    assert m["decoupled_ppo/behav_weight_le_1.25"][0].tolist() == [0.0, 1.0, 0.0]
    assert m["decoupled_ppo/behav_weight_le_2"][0].tolist() == [1.0, 1.0, 0.0]


def test_decoupled_ppo_without_a_cap_keeps_every_token():
    x = LossInputs(log([0.9]), log([0.1]), torch.ones(1, 1), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long))
    loss, _ = algo("decoupled_ppo", behav_weight_cap=0.0, behav_kl_coef=0.0).token_loss(x)
    assert loss.item() == pytest.approx(-9.0, rel=1e-5)


def test_seq_mis_keeps_or_drops_whole_sequences_by_their_weight():
    # Two packed sequences. Sequence 0: ratios 2 and 1.5, ρ = 3 > 2, dropped. Sequence 1: 0.8 and 1.25, ρ = 1.
    prox = log([0.6, 0.3, 0.4, 0.5])
    behav = log([0.3, 0.2, 0.5, 0.4])
    x = LossInputs(prox, behav, torch.ones(1, 4), torch.ones(1, 4), torch.tensor([[0, 0, 1, 1]]))
    loss, m = algo("seq_mis").token_loss(x)
    assert loss[0].tolist() == pytest.approx([0.0, 0.0, -1.0, -1.0], abs=1e-5)
    assert m["seq_mis/masked_frac_seq_weight"][0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert m["seq_mis/seq_weight_mean"][0].tolist() == pytest.approx([3.0, 3.0, 1.0, 1.0], rel=1e-5)
    # Geometric: ρ0 = sqrt(3) ≈ 1.73 is inside the band; every token of sequence 0 weighs it.
    loss, _ = algo("seq_mis", geometric=True).token_loss(x)
    assert loss[0].tolist() == pytest.approx([-math.sqrt(3)] * 2 + [-1.0, -1.0], rel=1e-5)


def test_a_token_off_the_mask_does_not_move_the_sequence_weight():
    prox, behav = log([0.6, 0.3, 0.9]), log([0.3, 0.3, 0.1])  # the masked third token has ratio 9
    x = LossInputs(prox, behav, torch.ones(1, 3), torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[0, 0, -1]]))
    loss, _ = algo("seq_mis", seq_is_high=2.5).token_loss(x)
    assert loss[0, :2].tolist() == pytest.approx([-2.0, -2.0], rel=1e-5)


@pytest.mark.parametrize("name,kw,match", [
    ("decoupled_ppo", {"tis_mode": "truncate"}, "tis_mode = 'off'"),
    ("decoupled_ppo", {"behav_weight_cap": -1.0}, "behav_weight_cap must be >= 0"),
    ("decoupled_ppo", {"behav_kl_coef": -0.5}, "behav_kl_coef must be >= 0"),
    ("seq_mis", {"seq_is_low": 1.5}, "seq_is_low < 1 < seq_is_high"),
    ("seq_mis", {"tis_mode": "mask"}, "tis_mode = 'off'"),
])
def test_bad_settings_are_refused_naming_the_key(name, kw, match):
    with pytest.raises(ConfigError, match=match):
        build(AlgorithmConfig, {"name": name, **kw}).validate()


def test_a_step_reports_the_algorithms_own_metrics_as_token_means_under_its_prefix():
    # One sequence of 2 response tokens (prompt 1): engine logprobs log 0.25 and log 0.5 against the
    # trainer's log 0.5 and log 0.5, so w = 2 and 1; cap 1.5 drops the first token.
    seq = TrainSequence(tokens=[1, 2, 3], prompt_len=1, loss_mask=[1, 1],
                        old_logprobs=[math.log(0.25), math.log(0.5)], advantage=1.0)
    mb = build_micro_batch([seq], [0.5], False, 0)
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    a = algo("decoupled_ppo", behav_weight_cap=1.5, behav_kl_coef=0.0)
    sums: dict = {}
    loss = micro_batch_loss(a, mb, ForwardOutputs(logp), sums, 1, True)
    assert loss.item() == pytest.approx(-0.5)  # token mean of (0, -1)
    out = step_metrics(a, sums)
    assert out["decoupled_ppo/clipped_frac_weight_cap"] == pytest.approx(0.5)
    assert out["decoupled_ppo/behav_weight_mean"] == pytest.approx(1.5)
    assert out["decoupled_ppo/behav_weight_le_1.25"] == pytest.approx(0.5)
    assert out["train/loss"] == pytest.approx(-0.5)


def test_a_stale_token_that_plain_ppo_clips_to_no_gradient_still_teaches_under_decoupled_ppo():
    # The policy moved since sampling: π_θ/π_behav = 1.5 on a token with A > 0. GRPO's clip around the
    # behaviour policy (1.2) leaves it no gradient; decoupled PPO weighs its policy gradient by 1.5.
    def grad(name, **kw):
        lp = log([0.6]).clone().requires_grad_(True)
        x = LossInputs(lp, log([0.4]), torch.ones(1, 1), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long))
        loss, _ = algo(name, **kw).token_loss(x)
        loss.sum().backward()
        return lp.grad.item()

    assert grad("grpo") == 0.0
    assert grad("decoupled_ppo", behav_kl_coef=0.0) == pytest.approx(-1.5, rel=1e-5)
    # As shipped, the KL penalty pulls back by log 1.5, how far the token moved: it still teaches.
    assert grad("decoupled_ppo") == pytest.approx(-1.5 + math.log(1.5), rel=1e-5)


def test_group_reweight_with_equal_weights_is_grpo():
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    a = algo("decoupled_ppo", group_reweight=True)
    assert a.reweighted_advantages(rewards, [0.3] * 8) == pytest.approx(a.advantages(rewards))


def test_group_reweight_recentres_a_group_the_policy_has_since_learned():
    # Sampled 3/8 correct; the current policy makes the correct answer 2× likelier and the wrong ones
    # 0.4×: under it the group would succeed 75% of the time. Fresh at 75%, GRPO would give the rarer
    # wrong answer the larger (negative) advantage and the common right one a smaller positive one.
    rewards = [1.0] * 3 + [0.0] * 5
    a = algo("decoupled_ppo", group_reweight=True)
    stale = a.advantages(rewards)
    fresh = a.reweighted_advantages(rewards, [math.log(2.0)] * 3 + [math.log(0.4)] * 5)
    assert stale[0] == pytest.approx(1.291, abs=1e-3) and stale[-1] == pytest.approx(-0.775, abs=1e-3)
    std = math.sqrt(0.75 * 0.25)
    assert fresh[0] == pytest.approx(0.25 / std, abs=1e-3) and fresh[-1] == pytest.approx(-0.75 / std, abs=1e-3)
    # Weighted by the current policy, the advantages are centred again.
    w = [2.0] * 3 + [0.4] * 5
    assert sum(wi * f for wi, f in zip(w, fresh)) == pytest.approx(0.0, abs=1e-6)


def test_group_reweight_floors_the_spread_of_a_group_the_policy_would_all_but_solve():
    rewards = [1.0] * 3 + [0.0] * 5
    adv = algo("decoupled_ppo", group_reweight=True).reweighted_advantages(rewards, [30.0] * 3 + [0.0] * 5)
    # The spread of a fresh group of 8 with one sample apart, √7/8, not ~0: finite, like a 7-of-8 group's.
    assert adv[-1] == pytest.approx(-8 / math.sqrt(7), rel=1e-4) and adv[0] == pytest.approx(0.0, abs=1e-4)


def test_reweight_groups_reads_each_sequence_weight_over_its_loss_tokens():
    from miles.buffer.types import Group, Sample
    from miles.trainer.batching import reweight_groups, sequences_from_groups

    a = algo("decoupled_ppo", group_reweight=True)
    # Two correct, two wrong; the current policy doubled the correct answers' probability (one token
    # each, log 2) and kept the wrong ones'. A masked token's ratio (the second) does not count.
    samples = [Sample(prompt_ids=[1], response_ids=[5, 6], rollout_logprobs=[-1.0, -1.0], loss_mask=[1, 0], reward=r)
               for r in (1.0, 1.0, 0.0, 0.0)]
    groups = [Group(samples)]
    seqs = sequences_from_groups(groups, a)
    shift = {1.0: math.log(2.0), 0.0: 0.0}
    seqs = [TrainSequence(**{**s.__dict__, "prox_logprobs": [-1.0 + shift[r], 5.0]})
            for s, r in zip(seqs, (1.0, 1.0, 0.0, 0.0))]
    out, metrics = reweight_groups(groups, seqs, a)
    # Under the current policy the group succeeds 4/(4 + 2) = 2/3 of the time, not 1/2.
    assert metrics["train/group_baseline_shift"] == pytest.approx(1 / 6)
    std = math.sqrt(2 / 9)
    assert [s.advantage for s in out] == pytest.approx([1 / 3 / std] * 2 + [-2 / 3 / std] * 2, abs=1e-4)


def test_the_second_moment_trust_region_drops_the_most_moved_tokens_until_the_batch_is_within_it():
    from miles.trainer.algorithms.decoupled_ppo import second_moment_keep

    # Squared log-ratios 0.01, 0.01, 0.25, 0 on loss tokens (the fifth is off the mask): keeping the three
    # smallest leaves a mean of 0.0067 <= 0.04; adding 0.25 would make it 0.0675.
    log_ratio = torch.tensor([[0.1, -0.1, 0.5, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    assert second_moment_keep(log_ratio, mask, 0.04).tolist() == [[True, True, False, True, True]]
    assert second_moment_keep(log_ratio, mask, 1.0).all()
    # In the loss: the dropped token adds nothing, and counts as dropped.
    lp = torch.zeros(1, 5, requires_grad=True)
    x = LossInputs(lp, -log_ratio, torch.ones(1, 5), mask, torch.zeros(1, 5, dtype=torch.long))
    loss, metrics = algo("decoupled_ppo", m2_threshold=0.04, behav_weight_cap=0.0,
                         behav_kl_coef=0.0).token_loss(x)
    assert loss[0, 2].item() == 0.0 and metrics["decoupled_ppo/clipped_frac_weight_cap"][0, 2].item() == 1.0
    assert loss[0, 0].item() == pytest.approx(-math.exp(0.1))


def test_sequence_weight_gives_every_token_its_sequences_ratio():
    # Sequence 0: token ratios 2 and 0.25, so ρ = 0.5 on both of its tokens.
    # tokens. Sequence 1: one token at ratio 3. The off-mask position adds nothing.
    prox = log([0.5, 0.2, 0.9, 0.3])
    behav = log([0.25, 0.8, 0.3, 0.9])
    x = LossInputs(prox.clone(), behav, torch.ones(1, 4), torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
                   torch.tensor([[0, 0, 1, 1]]))
    w, raw, _ = algo("decoupled_ppo", sequence_weight=True).behaviour_weights(x, prox)
    assert raw[0, :3].tolist() == pytest.approx([0.5, 0.5, 3.0], rel=1e-5)
    token_level, _, _ = algo("decoupled_ppo").behaviour_weights(x, prox)
    assert token_level[0, :3].tolist() == pytest.approx([2.0, 0.25, 3.0], rel=1e-5)


def test_the_behaviour_kl_penalty_pulls_moved_tokens_back_and_leaves_fresh_ones_alone():
    # The first token moved from 0.25 (behaviour) to 0.5 since it was sampled; the second did not move.
    # With zero advantages only the penalty is left: coef · ½ δ², δ = log π_θ − log π_behav.
    lp = log([0.5, 0.4]).clone().requires_grad_(True)
    x = LossInputs(lp, log([0.25, 0.4]), torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long))
    loss, m = algo("decoupled_ppo", behav_kl_coef=2.0).token_loss(x)
    d = math.log(2.0)
    assert loss[0].tolist() == pytest.approx([d * d, 0.0], abs=1e-6)
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([2.0 * d, 0.0], abs=1e-6)  # descent lowers the moved token
    assert m["decoupled_ppo/behav_kl"][0].tolist() == pytest.approx([d * d / 2, 0.0], abs=1e-6)
    # Off (AReaL's objective): the same inputs give no loss and no gradient; the metric is still reported.
    assert algo("decoupled_ppo").cfg.behav_kl_coef == 1.0  # on by default
    lp.grad = None
    loss, m = algo("decoupled_ppo", behav_kl_coef=0.0).token_loss(x)
    loss.sum().backward()
    assert loss.abs().sum().item() == 0.0 and lp.grad.abs().sum().item() == 0.0
    assert m["decoupled_ppo/behav_kl"][0, 0].item() == pytest.approx(d * d / 2, abs=1e-6)
