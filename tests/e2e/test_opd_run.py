"""On-policy distillation in a real run (Ray, engine processes, a gloo trainer): the student's
engines sample, the teacher (in the trainer, or on engines of its own) scores those tokens, the step
reports the reverse KL, which falls over a few steps, and the engines keep receiving the student's
weights while the teacher's checkpoint and engines never change."""

import hashlib
import json
import math
import shutil
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


def taught_teacher(student_dir: str, out: Path) -> str:
    """The student's own checkpoint after 5 supervised steps on the task's answers: it differs clearly
    from the student (a reverse KL of about 0.3 nats per token on the student's samples), in a direction
    a few distillation steps can follow. A randomly drawn teacher differs in ways a few steps cannot
    undo, so its reverse KL only moves within its sampling noise."""
    import torch

    from miles.models.loading import load_model, load_tokenizer
    from miles.data.tasks.arithmetic import ArithmeticTask, demonstration

    shutil.copytree(student_dir, out)
    tok, model = load_tokenizer(student_dir), load_model(student_dir, "float32")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    torch.manual_seed(0)
    problems = ArithmeticTask(split="train", seed=123).take(5 * 64)
    for step in range(5):
        batch = problems[step * 64:(step + 1) * 64]
        seqs = [tok(demonstration(p), add_special_tokens=False).input_ids + [tok.eos_token_id] for p in batch]
        starts = [len(tok(p.prompt, add_special_tokens=False).input_ids) for p in batch]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.eos_token_id] * (width - len(s)) for s in seqs])  # (B, T)
        mask = torch.zeros(len(seqs), width - 1)  # (B, T-1): answer tokens and EOS
        for i, (s, start) in enumerate(zip(seqs, starts)):
            mask[i, start - 1:len(s) - 1] = 1
        logprobs = torch.log_softmax(model(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logprobs * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def taught_teacher_dir(tiny_model_dir, tmp_path_factory):
    return taught_teacher(tiny_model_dir, tmp_path_factory.mktemp("taught-teacher") / "teacher")


@pytest.mark.parametrize("schedule", [pytest.param(s, marks=pytest.mark.slow) for s in ("sync", "fully_async")])
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


def test_distillation_from_teacher_engines_the_reverse_kl_falls_and_the_teacher_engines_never_update(
        tiny_model_dir, taught_teacher_dir, tmp_path, ray_cluster):
    """Teacher engines the run starts (teacher.model.path) score every group during the rollout; the
    trainer distils from those scores, the reverse KL falls, the student's engines get each new version,
    and the teacher's engines answer with one version throughout."""
    from miles.orchestration.driver import run_train

    before = digest(taught_teacher_dir)
    cfg = small_config(tiny_model_dir, tmp_path, **{
        "run.name": "opd-engines", "loop.num_steps": "5", "eval.every_steps": "0", "buffer.filter": "none",
        "rollout.max_new_tokens": "8", "rollout.n_samples_per_prompt": "4", "rollout.prompts_per_step": "16",
        "trainer.lr": "3e-3", "trainer.algorithm.name": "opd", "teacher.model.path": taught_teacher_dir,
        "teacher.num_engines": "1"})
    run_train(cfg)
    steps = [json.loads(line) for line in (tmp_path / "opd-engines" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        # The teacher engines' scores reached the loss: real log-probabilities, a finite reverse KL.
        assert r["opd/teacher_logprob"] < 0 and math.isfinite(r["opd/reverse_kl"])
        assert r["rollout/teacher_weight_versions"] == 1  # the teacher engines never changed version
    kl = [r["opd/reverse_kl"] for r in steps]
    # The student moved towards the teacher on its own samples: the last two steps' reverse KL is well
    # below the first two's (each step's estimate is a mean over about 500 sampled tokens).
    assert (kl[-2] + kl[-1]) / 2 < 0.8 * (kl[0] + kl[1]) / 2, kl
    assert steps[-1]["rollout/weight_version"] == 4  # the student's engines got the student's new weights
    assert digest(taught_teacher_dir) == before
