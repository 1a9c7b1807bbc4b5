"""On-policy distillation: the teacher's per-token judgement as the advantage, on hand-worked
tensors; the refusals at start (no teacher, another tokenizer); and a real trainer step whose
reported reverse KL equals a hand computation with the two checkpoints, falls over a few steps,
and never moves the teacher."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from miles.config import ConfigError, load_config
from miles.config.loader import build
from miles.run_config import RunConfig
from miles.net import free_port
from miles.trainer.algorithms import AlgorithmConfig, get_algorithm
from miles.trainer.algorithms.base import LossInputs
from miles.trainer.batching import build_micro_batch
from miles.trainer.loss import ForwardOutputs, micro_batch_loss, step_metrics
from miles.trainer.types import TrainSequence


def opd(**settings):
    return get_algorithm(build(AlgorithmConfig, {"name": "opd", "opd": {"teacher_path": "unused", **settings}}))


def log(values):
    return torch.log(torch.tensor([values], dtype=torch.float32))


def inputs(student, teacher, adv, seq_ids):
    lp = log(student)
    n = lp.shape[1]
    return LossInputs(lp, lp.clone(), torch.tensor([adv]), torch.ones(1, n), torch.tensor([seq_ids]),
                      teacher_logprobs=log(teacher))


def test_per_token_advantage_is_teacher_minus_student_logprob():
    # Student 0.5, 0.2; teacher 0.25, 0.4: k = log 2, log 0.5; A = -k = (-log 2, log 2).
    x = inputs([0.5, 0.2], [0.25, 0.4], [3.0, 3.0], [0, 0])
    loss, m = opd(kl_coef=1.0).token_loss(x)
    # On-policy (ratio 1): loss = -A.
    assert loss[0].tolist() == pytest.approx([math.log(2), -math.log(2)], rel=1e-5)
    assert m["opd/reverse_kl"][0].tolist() == pytest.approx([math.log(2), -math.log(2)], rel=1e-5)
    assert m["opd/teacher_logprob"][0].tolist() == pytest.approx([math.log(0.25), math.log(0.4)], rel=1e-5)


def test_reward_mix_and_sequence_level_kl():
    # Two sequences: k = (log 2, log 2) and (log 0.5); task advantages 1 and -1.
    x = inputs([0.5, 0.5, 0.2], [0.25, 0.25, 0.4], [1.0, 1.0, -1.0], [0, 0, 1])
    _, m = opd(kl_coef=0.5, reward_coef=2.0, kl_level="sequence").token_loss(x)
    # A = 2·A_task − 0.5·Σ_seq k: seq 0: 2 − 0.5·2 log 2; seq 1: −2 + 0.5·log 2.
    a0, a1 = 2 - math.log(2), -2 + 0.5 * math.log(2)
    assert m["opd/advantage"][0].tolist() == pytest.approx([a0, a0, a1], rel=1e-5)


def test_a_step_reports_reverse_kl_and_teacher_logprob_as_token_means():
    seq = TrainSequence(tokens=[1, 2, 3], prompt_len=1, loss_mask=[1, 1], old_logprobs=[math.log(0.5), math.log(0.2)])
    mb = build_micro_batch([seq], [0.5], False, 0)
    out = ForwardOutputs(log([0.5, 0.2]).requires_grad_(True), teacher_logprobs=log([0.25, 0.4]))
    sums: dict = {}
    micro_batch_loss(opd(), mb, out, sums, 1, True)
    m = step_metrics(opd(), sums)
    assert m["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-6)  # (log 2 + log 0.5) / 2
    assert m["opd/teacher_logprob"] == pytest.approx((math.log(0.25) + math.log(0.4)) / 2, rel=1e-5)


def run_config(model_dir, tmp_path, **over):
    base = {"model.path": model_dir, "run.output_dir": str(tmp_path), "trainer.algorithm.name": "opd"}
    base.update(over)
    return load_config(RunConfig, None, base)


def test_opd_without_a_teacher_is_refused_naming_the_key(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="trainer.algorithm.opd.teacher_path is required"):
        run_config(tiny_model_dir, tmp_path)


def test_a_teacher_with_another_tokenizer_is_refused_at_start_with_the_reason(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra-token>"])
    tok.save_pretrained(other)
    with pytest.raises(ConfigError, match="another tokenizer than model.path.*vocabulary has"):
        run_config(tiny_model_dir, tmp_path, **{"trainer.algorithm.opd.teacher_path": str(other)})
    # The same tokenizer is accepted.
    cfg = run_config(tiny_model_dir, tmp_path, **{"trainer.algorithm.opd.teacher_path": tiny_model_dir})
    assert cfg.trainer.algorithm.opd.kl_coef == 1.0


def test_the_arithmetic_example_config_is_pure_distillation_from_a_teacher_engine(tiny_model_dir, tmp_path):
    example, shipped = "examples/arithmetic/opd.toml", "examples/arithmetic/grpo.toml"
    over = {"model.path": tiny_model_dir, "run.output_dir": str(tmp_path)}
    cfg = load_config(RunConfig, example, {**over, "teacher.model.path": tiny_model_dir})
    assert cfg.trainer.algorithm.name == "opd" and cfg.trainer.algorithm.opd.reward_coef == 0
    assert cfg.teacher.model.path == tiny_model_dir and cfg.teacher.num_engines == 1
    assert cfg.buffer.filter == "none" and cfg.rollout.temperature == 1.0
    # The GRPO example's task and sampling, so the two compare at one sampling budget.
    grpo = load_config(RunConfig, shipped, over)
    assert (cfg.rollout.task, cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt,
            cfg.rollout.max_new_tokens) == (grpo.rollout.task, grpo.rollout.prompts_per_step,
                                            grpo.rollout.n_samples_per_prompt, grpo.rollout.max_new_tokens)
    with pytest.raises(ConfigError, match="teacher.model.path"):
        load_config(RunConfig, example, over)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from miles.models.presets import build_tiny_model

    # The same preset and tokenizer, other weights: a different model to distil from.
    return str(build_tiny_model("tiny-qwen3", tmp_path_factory.mktemp("teacher"), seed=0, init_std=0.05))


def test_trainer_reports_the_hand_computed_reverse_kl_which_falls_and_the_teacher_never_moves(
        tiny_model_dir, teacher_dir, gloo):
    from miles.models.loading import load_model
    from miles.trainer.trainer import Trainer
    from miles.trainer.config import TrainerConfig

    cfg = build(TrainerConfig, {"lr": 5e-5, "algorithm": {"name": "opd", "opd": {"teacher_path": teacher_dir}}})
    trainer = Trainer(cfg, tiny_model_dir, 0, 1, "127.0.0.1", free_port())
    tokens, prompt_len = [5, 17, 9, 30, 41, 12, 7], 3
    # Hand computation: each checkpoint's logprob of every response token given what precedes it.
    def response_logprobs(path):
        model = load_model(path, "float32").eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        return lp[prompt_len - 1:]
    student, teacher = response_logprobs(tiny_model_dir), response_logprobs(teacher_dir)
    expected = float((student - teacher).mean())
    seq = TrainSequence(tokens=tokens, prompt_len=prompt_len, loss_mask=[1] * 4, old_logprobs=student.tolist())
    teacher_before = {n: p.clone() for n, p in trainer.teacher.model.state_dict().items()}

    kls = [trainer.train_step([seq], 4)["opd/reverse_kl"] for _ in range(4)]
    assert kls[0] == pytest.approx(expected, rel=1e-4)
    assert abs(expected) > 0.1  # the two models disagree on these tokens, so there is something to learn
    assert kls[-1] < kls[0] - 0.1  # the student moved towards the teacher on its own tokens
    assert all(torch.equal(p, teacher_before[n]) for n, p in trainer.teacher.model.state_dict().items())


def test_teacher_engine_logprobs_on_the_samples_are_what_the_trainer_distils_from(tiny_model_dir, teacher_dir, gloo):
    """No in-trainer teacher (teacher engines scored the samples during the rollout): the trainer takes
    the teacher's logprobs from the sequences, reports the same reverse KL, and it falls."""
    from miles.models.loading import load_model
    from miles.trainer.trainer import Trainer
    from miles.trainer.config import TrainerConfig

    cfg = build(TrainerConfig, {"lr": 5e-5, "algorithm": {"name": "opd"}})
    trainer = Trainer(cfg, tiny_model_dir, 0, 1, "127.0.0.1", free_port())
    assert trainer.teacher is None
    tokens, prompt_len = [5, 17, 9, 30, 41, 12, 7], 3

    def response_logprobs(path):
        model = load_model(path, "float32").eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0][prompt_len - 1:]

    student, teacher = response_logprobs(tiny_model_dir), response_logprobs(teacher_dir)
    seq = TrainSequence(tokens=tokens, prompt_len=prompt_len, loss_mask=[1] * 4, old_logprobs=student.tolist(),
                        teacher_logprobs=teacher.tolist())
    kls = [trainer.train_step([seq], 4)["opd/reverse_kl"] for _ in range(4)]
    assert kls[0] == pytest.approx(float((student - teacher).mean()), rel=1e-4)
    assert kls[-1] < kls[0] - 0.1
