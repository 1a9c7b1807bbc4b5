"""On-policy distillation in a real run (Ray, engine processes, a gloo trainer): the student's
engines sample, the trainer's frozen teacher scores those tokens, the step reports the reverse KL,
and the engines keep receiving the student's weights while the teacher's checkpoint is untouched."""

import hashlib
import json
import math
from pathlib import Path

import pytest

from tests.helpers.runs import small_config

pytestmark = pytest.mark.e2e


def digest(folder: str) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(folder).glob("*.safetensors")))).hexdigest()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from miles.models.presets import build_tiny_model

    # The student's preset and tokenizer with other weights.
    return str(build_tiny_model("tiny-qwen3", tmp_path_factory.mktemp("teacher"), seed=0, init_std=0.05))


@pytest.mark.parametrize("schedule", ["sync", "fully_async"])
def test_pure_distillation_run_reports_reverse_kl_from_the_teacher(tiny_model_dir, teacher_dir, tmp_path,
                                                                   ray_cluster, schedule):
    from miles.orchestration.driver import run_train

    before = digest(teacher_dir)
    cfg = small_config(tiny_model_dir, tmp_path, **{
        "run.name": "opd", "loop.schedule": schedule, "loop.num_steps": "2", "eval.every_steps": "0", "buffer.filter": "none",
        "rollout.max_new_tokens": "6", "rollout.n_samples_per_prompt": "1",
        "trainer.algorithm.name": "opd", "trainer.algorithm.opd.teacher_path": teacher_dir})
    run_train(cfg)
    steps = [json.loads(line) for line in (tmp_path / "opd" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # The teacher's logprobs of the student's tokens are real log-probabilities, and the reverse KL
        # estimate on them is finite (it is what the advantage is made of).
        assert r["opd/teacher_logprob"] < 0
        assert math.isfinite(r["opd/reverse_kl"]) and r["opd/reverse_kl"] != 0
        assert r["train/loss_tokens"] > 0
    if schedule == "sync":
        assert steps[-1]["rollout/weight_version"] == 1  # the student's engines got the student's new weights
    else:
        assert all(r["buffer/staleness_max"] <= 2 for r in steps)  # buffer.max_staleness, the default
    assert digest(teacher_dir) == before


def test_distillation_from_teacher_engines_the_student_moves_and_the_teacher_engines_never_update(
        tiny_model_dir, teacher_dir, tmp_path, ray_cluster):
    """Teacher engines the run starts (teacher.model.path) score every group during the rollout; the
    trainer distils from those scores, the student's engines get each new version, and the teacher's
    engines answer with one version throughout."""
    from miles.orchestration.driver import run_train

    cfg = small_config(tiny_model_dir, tmp_path, **{
        "run.name": "opd-engines", "loop.num_steps": "3", "eval.every_steps": "0", "buffer.filter": "none",
        "rollout.max_new_tokens": "6", "rollout.n_samples_per_prompt": "1", "rollout.prompts_per_step": "8",
        "trainer.algorithm.name": "opd", "teacher.model.path": teacher_dir, "teacher.num_engines": "1"})
    run_train(cfg)
    steps = [json.loads(line) for line in (tmp_path / "opd-engines" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        # The teacher engines' scores reached the loss: real log-probabilities, a finite reverse KL.
        assert r["opd/teacher_logprob"] < 0
        assert math.isfinite(r["opd/reverse_kl"]) and r["opd/reverse_kl"] != 0
        assert r["rollout/teacher_weight_versions"] == 1  # the teacher engines never changed version
    assert steps[-1]["rollout/weight_version"] == 2  # the student's engines got the student's new weights
