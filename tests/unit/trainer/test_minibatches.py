"""Several optimizer updates per RL step (`trainer.minibatches_per_step`): how a step's groups split
into minibatches, the proximal policy the trainer records before the first update, and what it does
to decoupled PPO's clip and TIS's weights (on a real tiny model where the trainer is involved)."""

import math

import pytest
import torch

from miles.buffer.types import Group, Sample
from miles.config import ConfigError
from miles.config.loader import build
from miles.net import free_port
from miles.trainer.algorithms import AlgorithmConfig, get_algorithm
from miles.trainer.algorithms.base import LossInputs
from miles.trainer.batching import build_micro_batch, build_step, minibatch_sizes
from miles.trainer.config import TrainerConfig
from miles.trainer.correction import corrected_inputs
from miles.trainer.trainer import Trainer
from miles.trainer.types import BatchTotals, TrainSequence


@pytest.fixture
def gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _group(n: int) -> Group:
    return Group([Sample(prompt_ids=[1], response_ids=[5], rollout_logprobs=[-0.1], loss_mask=[1])
                  for _ in range(n)])


def _seqs():
    # Two prompts, a better and a worse answer each; behaviour logprobs as an older policy's.
    out = []
    for prompt in ([5, 9], [6, 11]):
        for answer, adv in (([14, 20, 31], 1.0), ([17, 23, 8], -1.0)):
            out.append(TrainSequence(tokens=prompt + answer, prompt_len=2, loss_mask=[1, 1, 1],
                                     old_logprobs=[-6.0] * 3, advantage=adv))
    return out


def test_a_step_is_built_in_one_call_and_scores_the_batch_only_for_group_reweighting():
    groups = [Group([Sample(prompt_ids=[1], response_ids=[5, 6], rollout_logprobs=[-1.0, -1.0], loss_mask=[1, 1],
                            reward=r) for r in rewards]) for rewards in ([1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 1.0])]
    scored = []

    def score(seqs):  # the ranks' forward: the current policy finds the correct answers likelier
        scored.append(len(seqs))
        return [[-0.5, -1.0] if s.advantage > 0 else [-1.0, -1.0] for s in seqs]

    grpo = get_algorithm(AlgorithmConfig(name="grpo"))
    step = build_step(groups, grpo, 2, score)
    assert scored == [] and step.metrics == {}
    # Two minibatches of whole groups (the second holds two), each normalised by its own totals.
    assert [(len(part), totals.loss_tokens) for part, totals in step.minibatches] == [(2, 4), (6, 12)]
    assert [s.advantage for s in step.minibatches[0][0]] == pytest.approx([1.0, -1.0], abs=1e-5)

    reweighting = get_algorithm(build(AlgorithmConfig, {"name": "decoupled_ppo", "group_reweight": True}))
    step = build_step(groups, reweighting, 2, score)
    assert scored == [8] and step.metrics["train/group_baseline_shift"] > 0
    seqs = [s for part, _ in step.minibatches for s in part]
    assert all(s.prox_logprobs is not None for s in seqs)  # recorded once: the step's proximal logprobs
    # Under the current policy the correct answers are likelier, so the groups' baselines rise.
    assert seqs[0].advantage < 1.0 and seqs[1].advantage < -1.0


def test_minibatches_are_runs_of_whole_groups_as_even_as_they_divide():
    groups = [_group(n) for n in (8, 8, 8, 8, 8)]
    assert minibatch_sizes(groups, 2) == [16, 24]
    assert minibatch_sizes(groups, 1) == [40]
    assert minibatch_sizes([_group(4), _group(2)], 4) == [4, 2]  # no more minibatches than groups
    assert minibatch_sizes([], 3) == [0]


def test_per_sequence_results_come_back_from_the_ranks_in_the_global_order():
    from miles.orchestration.trainer_group import join_from_ranks, split_for_ranks

    seqs = list(range(7))
    for ranks, tp in ((1, 1), (2, 1), (3, 1), (4, 2)):
        shards = split_for_ranks(seqs, ranks, tp)
        assert join_from_ranks([[10 * s for s in shard] for shard in shards], ranks, tp) == [10 * s for s in seqs]


def test_zero_minibatches_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="trainer.minibatches_per_step"):
        build(TrainerConfig, {"minibatches_per_step": 0}).validate()


def test_the_micro_batch_carries_proximal_logprobs_only_when_every_sequence_has_them():
    seqs = _seqs()[:2]
    assert build_micro_batch(seqs, [1.0, 1.0], False, 0).prox_logprobs is None
    recorded = [TrainSequence(**{**s.__dict__, "prox_logprobs": [-1.0, -2.0, -3.0]}) for s in seqs]
    mb = build_micro_batch(recorded, [1.0, 1.0], False, 0)
    # Response token j of a sequence is predicted at position prompt_len - 1 + j.
    assert mb.prox_logprobs[0, 1:4].tolist() == [-1.0, -2.0, -3.0] and mb.prox_logprobs[0, 0] == 0


def test_decoupled_ppo_clips_around_a_recorded_proximal_policy():
    # π_prox = 0.4 was recorded before the step's first update; that update took π_θ to 0.6 (r = 1.5).
    lp = torch.log(torch.tensor([[0.6]])).requires_grad_(True)
    x = LossInputs(lp, torch.log(torch.tensor([[0.4]])), torch.ones(1, 1), torch.ones(1, 1),
                   torch.zeros(1, 1, dtype=torch.long), prox_logprobs=torch.log(torch.tensor([[0.4]])))
    areal = get_algorithm(build(AlgorithmConfig, {"name": "decoupled_ppo", "behav_kl_coef": 0.0}))
    loss, metrics = areal.token_loss(x)
    loss.sum().backward()
    assert metrics["decoupled_ppo/clipped_frac_ratio"].item() == 1.0
    assert lp.grad.item() == 0.0  # clipped at 1 + ε: this token's update is spent for this step
    assert loss.item() == pytest.approx(-1.2)  # w = π_prox/π_behav = 1 times the clipped 1.2·A
    # With the KL penalty (the default) the token moved since sampling is pulled back by log 1.5.
    lp.grad = None
    loss, _ = get_algorithm(build(AlgorithmConfig, {"name": "decoupled_ppo"})).token_loss(x)
    loss.sum().backward()
    assert lp.grad.item() == pytest.approx(math.log(1.5), rel=1e-5)


def test_tis_weights_and_clips_against_a_recorded_proximal_policy():
    x = LossInputs(torch.log(torch.tensor([[0.6]])), torch.log(torch.tensor([[0.2]])), torch.ones(1, 1),
                   torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long),
                   prox_logprobs=torch.log(torch.tensor([[0.4]])))
    corrected, w, _ = corrected_inputs(x, "truncate", 0.0, 5.0)
    assert w.item() == pytest.approx(2.0)  # π_prox/π_rollout, not π_θ/π_rollout = 3
    assert torch.equal(corrected.old_logprobs, x.prox_logprobs)


def _trainer(tiny_model_dir, k_name="decoupled_ppo"):
    cfg = build(TrainerConfig, {"lr": 5e-2, "grad_clip": 0.0, "algorithm": {"name": k_name}})
    return Trainer(cfg, tiny_model_dir, 0, 1, "127.0.0.1", free_port())


def test_the_proximal_policy_is_the_start_of_the_step_and_the_clip_binds_from_the_second_update(tiny_model_dir, gloo):
    trainer = _trainer(tiny_model_dir)
    seqs = _seqs()
    before = trainer.proximal_logprobs(seqs, trainer.algorithm)
    assert [len(p) for p in before] == [3, 3, 3, 3]
    # The same batch twice: the first update moves exactly the tokens the second trains on.
    out = trainer.train_minibatches([(seqs, BatchTotals.of(seqs)), (seqs, BatchTotals.of(seqs))])
    after = trainer.proximal_logprobs(seqs, trainer.algorithm)
    assert out["train/minibatches"] == 2.0 and trainer.step == 1
    moved = max(abs(a - b) for pa, pb in zip(after, before) for a, b in zip(pa, pb))
    assert moved > 0.2  # two updates at this lr move the policy well past the clip range
    # The first minibatch is at r = 1 (nothing clipped); in the second the ratio to the recorded start
    # left [0.8, 1.2] on some tokens. The step reports the mean over the two.
    assert 0.0 < out["decoupled_ppo/clipped_frac_ratio"] <= 0.5


def test_one_update_per_step_never_clips_decoupled_ppo(tiny_model_dir, gloo):
    trainer = _trainer(tiny_model_dir)
    seqs = _seqs()
    for _ in range(2):
        out = trainer.train_step(seqs, BatchTotals.of(seqs))
        assert out["decoupled_ppo/clipped_frac_ratio"] == 0.0 and "train/minibatches" not in out
    assert trainer.step == 2
