"""`miles bench distill`'s pieces: the two runs it compares differ only in the algorithm (and the filter
pure distillation needs), so they spend the same sampling budget from the same start; and how it reads
a run's eval curve. (The whole bench trains two SFT checkpoints and two RL runs: minutes, not a test.)"""

import json
from functools import reduce

import pytest

from benchmarks import distill


def test_opd_and_grpo_runs_share_every_setting_but_the_algorithm(tiny_model_dir, tmp_path):
    args = distill.parse_args(["--steps", "7", "--prompts-per-step", "6", "--samples", "3", "--eval-prompts", "10",
                               "--seed", "2"])
    runs = distill.run_configs(args, tiny_model_dir, tiny_model_dir, tmp_path)
    opd, grpo = runs["opd"], runs["grpo"]
    for cfg in (opd, grpo):
        assert cfg.model.path == tiny_model_dir
        assert (cfg.loop.num_steps, cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt) == (7, 6, 3)
        assert (cfg.eval.num_prompts, cfg.run.seed) == (10, 2)
    # The same sampling and optimisation as the example's GRPO: tokens, temperature, lr, clip range.
    for key in ("rollout.max_new_tokens", "rollout.temperature", "trainer.lr", "trainer.algorithm.clip_eps_low",
                "rollout.task.digits", "rollout.task.fixed_width"):
        assert reduce(getattr, key.split("."), opd) == reduce(getattr, key.split("."), grpo), key
    assert (opd.trainer.algorithm.name, grpo.trainer.algorithm.name) == ("opd", "grpo")
    # Pure distillation from a teacher engine; every group trained, not only those whose rewards differ.
    assert opd.trainer.algorithm.opd.reward_coef == 0 and opd.trainer.algorithm.opd.teacher_path == ""
    assert opd.teacher.model.path == tiny_model_dir and opd.teacher.num_engines == 1
    assert (opd.buffer.filter, grpo.buffer.filter) == ("none", "nonzero_std")
    assert not grpo.teacher.enabled

    inside = distill.run_configs(distill.parse_args(["--teacher-in", "trainer", "--only", "opd"]),
                                 tiny_model_dir, tiny_model_dir, tmp_path)
    assert list(inside) == ["opd"]
    assert inside["opd"].trainer.algorithm.opd.teacher_path == tiny_model_dir and not inside["opd"].teacher.enabled


def test_a_runs_curve_is_read_from_its_metrics(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.25},
            {"step": 1, "rollout/reward_mean": 0.3, "opd/reverse_kl": 2.0, "buffer/samples_trained": 16},
            {"step": 2, "rollout/reward_mean": 0.4, "opd/reverse_kl": 1.5, "buffer/samples_trained": 16,
             "eval/accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = distill.curve(tmp_path)
    assert c["eval_accuracy_by_step"] == {"0": 0.25, "2": 0.5}
    assert c["reverse_kl"] == [2.0, 1.5] and c["reward_mean"] == [0.3, 0.4] and c["samples_trained"] == 32


@pytest.mark.parametrize("argv, named", [(["--only", "opd,ppo"], "--only"), (["--steps", "0"], "--steps"),
                                         (["--student-target", "2"], "--student-target")])
def test_bad_arguments_are_refused_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit):
        distill.parse_args(argv)
    assert named in capsys.readouterr().err
