"""trainer/loss.py composes what the algorithm declares, on tiny hand-made tensors: KL as a loss term
or a reward penalty, the entropy bonus, off-policy correction on and off, PPO's critic path, SFT,
and a user's `module:function` algorithm loaded from a run config."""

import math

import pytest
import torch

from miles.config import load_config
from miles.config.loader import build
from miles.run_config import RunConfig
from miles.trainer.algorithms import AlgorithmConfig, get_algorithm
from miles.trainer.algorithms.base import clipped_surrogate, kl_estimate, kl_reward_penalty
from miles.trainer.algorithms.ppo import gae, value_loss
from miles.trainer.batching import MicroBatch
from miles.trainer.loss import ForwardOutputs, micro_batch_loss, step_metrics

LOGP = [[math.log(0.5), math.log(0.4), math.log(0.9)]]
OLD = [[math.log(0.4), math.log(0.5), math.log(0.9)]]
REF = [[math.log(0.6), math.log(0.2), math.log(0.8)]]
ADV = [[1.0, 1.0, 1.0]]
MASK = [[1.0, 1.0, 0.0]]          # the last position is not a loss token
WEIGHTS = [[0.5, 0.5, 0.0]]


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def micro_batch(adv=ADV):
    return MicroBatch(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=None, position_ids=None,
                      mask=t(MASK), weights=t(WEIGHTS), old_logprobs=t(OLD), advantages=t(adv),
                      seq_ids=torch.tensor([[0, 0, -1]]), seqs=[])


def algo(name="grpo", **kw):
    return get_algorithm(build(AlgorithmConfig, {"name": name, **kw}))


def loss_of(a, **outputs):
    sums = {}
    out = ForwardOutputs(logprobs=t(LOGP).requires_grad_(), **outputs)
    loss = micro_batch_loss(a, micro_batch(), out, sums, dp_size=1, real=True)
    return loss, sums


def surrogate(adv=None, old=OLD):
    loss, _ = clipped_surrogate(t(LOGP), t(old), t(ADV) if adv is None else adv, 0.2, 0.2)
    return loss


def test_plain_policy_loss_is_the_weighted_token_loss_with_its_metric_sums():
    loss, sums = loss_of(algo())
    assert loss.item() == pytest.approx((surrogate() * t(WEIGHTS)).sum().item())
    assert sums["loss"] == pytest.approx(loss.item()) and sums["tokens"] == 2.0
    assert sums["nll"] == pytest.approx(-(math.log(0.5) + math.log(0.4)), rel=1e-6)
    assert sums["logp_diff"] == pytest.approx(2 * math.log(1.25), rel=1e-5)
    assert "kl" not in sums and "entropy" not in sums and "tis_w" not in sums
    loss.backward()  # the loss carries the policy's gradient


def test_rollout_mismatch_metrics_are_k3_kl_and_the_share_of_tokens_off_by_more_than_a_tenth():
    # Loss tokens: r = 0.5 / 0.4 = 1.25 and 0.4 / 0.5 = 0.8; k3 = (r − 1 − log r) sums to 0.25 − 0.2 − log(1.25 · 0.8)
    # = 0.05, and both |log r| = 0.223 exceed 0.1. The masked third token counts for nothing.
    _, sums = loss_of(algo())
    m = step_metrics(algo(), sums)
    assert m["train/rollout_mismatch_kl"] == pytest.approx(0.05 / 2, rel=1e-5)
    assert m["train/rollout_mismatch_frac"] == 1.0
    # A masked filler logprob far below the policy's must not turn the sums into inf or NaN.
    mb = micro_batch()
    mb.old_logprobs[0, 2] = -1e4
    sums = {}
    micro_batch_loss(algo(), mb, ForwardOutputs(logprobs=t(LOGP).requires_grad_()), sums, dp_size=1, real=True)
    assert sums["mismatch_kl"] == pytest.approx(0.05, rel=1e-5) and sums["mismatch_tokens"] == 2.0


def test_kl_as_a_loss_term_adds_coef_times_the_estimate():
    a = algo(kl_coef=0.1, kl_estimator="k3")
    loss, sums = loss_of(a, ref_logprobs=t(REF))
    kl = kl_estimate(t(LOGP), t(REF), "k3")
    assert loss.item() == pytest.approx(((surrogate() + 0.1 * kl) * t(WEIGHTS)).sum().item(), rel=1e-6)
    assert sums["kl"] == pytest.approx((kl * t(MASK)).sum().item(), rel=1e-6)


def test_kl_as_a_reward_penalty_moves_the_advantages_not_the_loss():
    a = algo(kl_coef=0.1, kl_mode="reward")
    loss, sums = loss_of(a, ref_logprobs=t(REF))
    adv = kl_reward_penalty(t(ADV), t(LOGP), t(REF), t(MASK), torch.tensor([[0, 0, -1]]), 0.1)
    assert loss.item() == pytest.approx((surrogate(adv) * t(WEIGHTS)).sum().item(), rel=1e-6)
    assert "kl" in sums  # still reported


def test_entropy_bonus_is_subtracted():
    entropy = t([[1.0, 2.0, 3.0]])
    loss, sums = loss_of(algo(entropy_coef=0.01), entropy=entropy)
    assert loss.item() == pytest.approx(((surrogate() - 0.01 * entropy) * t(WEIGHTS)).sum().item(), rel=1e-6)
    assert sums["entropy"] == pytest.approx(3.0)


def test_off_policy_correction_on_and_off():
    off, _ = loss_of(algo())
    on, sums = loss_of(algo(tis_mode="truncate", tis_clip_low=0.0, tis_clip_high=1.1))
    # On: the surrogate runs against the current policy (ratio 1), each token weighted by the clipped ratio.
    w = torch.clamp(torch.exp(t(LOGP) - t(OLD)), max=1.1)
    expected = (surrogate(old=LOGP) * w * t(WEIGHTS)).sum().item()
    assert on.item() == pytest.approx(expected, rel=1e-6) and off.item() != pytest.approx(expected)
    assert sums["tis_w"] == pytest.approx((w * t(MASK)).sum().item(), rel=1e-6)
    assert "train/tis_ess" in step_metrics(algo(tis_mode="truncate"), sums)


def test_ppo_adds_the_critic_loss_and_trains_the_policy_on_gae_advantages():
    a = algo("ppo", gamma=1.0, gae_lambda=0.5, value_clip=0.0)
    values = t([[0.5, 0.5, 0.0]]).requires_grad_()
    loss, sums = loss_of(a, values=values)
    rewards = t([[0.0, 1.0, 0.0]])  # the sequence's reward sits on its last loss token
    adv, ret = gae(rewards, values.detach(), t(MASK), 1.0, 0.5)
    v = value_loss(values.detach(), values.detach(), ret, 0.0)
    expected = (surrogate(adv) * t(WEIGHTS)).sum() + (v * t(WEIGHTS)).sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert sums["value_loss"] == pytest.approx((v * t(MASK)).sum().item(), rel=1e-6)
    loss.backward()
    assert values.grad is not None and values.grad.abs().sum() > 0  # the critic learns from the same loss


def test_sft_is_an_algorithm_whose_loss_is_the_nll_reported_under_sft():
    sft = get_algorithm(AlgorithmConfig(name="sft"))
    assert not (sft.needs_reference or sft.needs_entropy or sft.needs_critic or sft.corrects_off_policy)
    loss, sums = loss_of(sft)
    assert loss.item() == pytest.approx(0.5 * -(math.log(0.5) + math.log(0.4)), rel=1e-6)
    assert "logp_diff" not in sums
    assert set(step_metrics(sft, sums)) == {"sft/loss", "sft/loss_tokens", "sft/nll"}


def test_a_users_module_function_algorithm_comes_from_the_run_config_and_is_the_loss_used(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen3"}')
    cfg = load_config(RunConfig, None, {"model.path": str(tmp_path / "model"),
                                        "trainer.algorithm.name": "tests.helpers.user_algorithm:make",
                                        "trainer.algorithm.kl_coef": "0.1"})
    a = get_algorithm(cfg.trainer.algorithm)
    assert type(a).__name__ == "ScaledReinforce" and a.needs_reference
    assert a.advantages([1.0, 0.0]) == [0.5, -0.5]
    loss, _ = loss_of(a, ref_logprobs=t(REF))
    kl = kl_estimate(t(LOGP), t(REF), "k3")
    expected = ((-3.0 * t(LOGP) * t(ADV) + 0.1 * kl) * t(WEIGHTS)).sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_each_algorithm_owns_its_config_keys(tmp_path):
    ppo = build(AlgorithmConfig, {"name": "ppo", "gamma": 0.9})
    assert type(ppo).__qualname__ == "PPO.Config" and ppo.gamma == 0.9
    assert build(AlgorithmConfig, {"name": "grpo", "std_normalize": False}).std_normalize is False
    from miles.config import ConfigError

    with pytest.raises(ConfigError, match="unknown key 'gamma'"):
        build(AlgorithmConfig, {"name": "grpo", "gamma": 0.9})
    with pytest.raises(ConfigError, match="unknown key 'std_normalize'"):
        build(AlgorithmConfig, {"name": "rloo", "std_normalize": False})
    with pytest.raises(ConfigError, match="need 0 < gamma <= 1"):
        build(AlgorithmConfig, {"name": "ppo", "gamma": 2.0}).validate()
