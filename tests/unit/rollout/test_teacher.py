"""Teacher engines (rollout/teacher.py): a group's samples scored by a real built-in engine in one
batched call equal the teacher checkpoint's own logprobs of the response tokens; a served teacher
with another tokenizer is refused with the reason; which config selects which teacher."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
import torch

from miles.buffer.types import Sample
from miles.config import ConfigError, load_config
from miles.engine_api.client import EngineClient
from miles.run_config import RunConfig
from miles.engine.config import EngineConfig
from miles.engine.server import start_server_thread
from miles.rollout.teacher import TeacherScorer, check_served_teacher


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from miles.models.presets import build_tiny_model

    # The student's preset and tokenizer with other weights.
    return str(build_tiny_model("tiny-qwen3", tmp_path_factory.mktemp("teacher"), seed=0, init_std=0.05))


@pytest.fixture(scope="module")
def other_tokenizer_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    other = tmp_path_factory.mktemp("other") / "model"
    shutil.copytree(tiny_model_dir, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra-token>"])
    tok.save_pretrained(other)
    return str(other)


@pytest.fixture(scope="module")
def teacher_engine(teacher_dir):
    srv = start_server_thread(EngineConfig(model_path=teacher_dir))
    yield srv
    srv.stop()


def response_logprobs(model_dir, prompt, response):
    from miles.models.loading import load_model

    ids = prompt + response
    with torch.no_grad():
        logits = load_model(model_dir, "float32").eval()(torch.tensor([ids])).logits[0, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp[len(prompt) - 1:].tolist()


def sample(prompt, response):
    return Sample(prompt_ids=prompt, response_ids=response, rollout_logprobs=[0.0] * len(response),
                  loss_mask=[1] * len(response))


def test_a_group_is_scored_in_one_call_with_the_teachers_logprobs_of_each_response_token(teacher_engine,
                                                                                           teacher_dir):
    prompt = [5, 17, 9, 30]
    samples = [sample(prompt, [41, 12, 7]), sample(prompt, [8]), sample(prompt, []), sample([3, 4], [11, 2, 6, 9])]
    calls = []

    async def record(request):
        calls.append(request)

    async def run():
        async with httpx.AsyncClient(timeout=60, event_hooks={"request": [record]}) as client:
            await TeacherScorer([teacher_engine.url]).score_group(client, samples)

    asyncio.run(run())
    assert len(calls) == 1  # one batched /generate for the group
    for s in samples:
        assert len(s.teacher_logprobs) == len(s.response_ids)
        if s.response_ids:
            torch.testing.assert_close(torch.tensor(s.teacher_logprobs),
                                       torch.tensor(response_logprobs(teacher_dir, s.prompt_ids, s.response_ids)),
                                       atol=2e-5, rtol=0)
    # Scoring generates nothing and changes nothing: the teacher still serves its starting weights.
    assert httpx.get(teacher_engine.url + "/get_weight_version").json()["weight_version"] == "default"


def test_a_served_teacher_with_another_tokenizer_is_refused_with_the_reason(tiny_model_dir, other_tokenizer_dir,
                                                                            teacher_engine):
    with EngineClient(timeout_s=30) as client:
        check_served_teacher(client, teacher_engine.url, tiny_model_dir)  # same tokenizer: accepted
        other = start_server_thread(EngineConfig(model_path=other_tokenizer_dir))
        try:
            with pytest.raises(ConfigError, match="tokenizer is not model.path's.*vocabulary has"):
                check_served_teacher(client, other.url, tiny_model_dir)
        finally:
            other.stop()


def run_config(model_dir, tmp_path, **over):
    base = {"model.path": model_dir, "run.output_dir": str(tmp_path), "trainer.algorithm.name": "opd",
            "rollout.n_samples_per_prompt": "1"}
    return load_config(RunConfig, None, {**base, **over})


def test_which_config_selects_which_teacher_and_the_refusals(tiny_model_dir, teacher_dir, other_tokenizer_dir,
                                                              tmp_path):
    # Engines the run starts, or engines already serving; the in-trainer teacher stays unset.
    cfg = run_config(tiny_model_dir, tmp_path, **{"teacher.model.path": teacher_dir, "teacher.num_engines": "2"})
    assert cfg.teacher.enabled and not cfg.trainer.algorithm.opd.teacher_path
    assert run_config(tiny_model_dir, tmp_path, **{"teacher.engine_urls": ["http://127.0.0.1:1"]}).teacher.enabled
    with pytest.raises(ConfigError, match="teacher.model.path .* another tokenizer than model.path"):
        run_config(tiny_model_dir, tmp_path, **{"teacher.model.path": other_tokenizer_dir})
    with pytest.raises(ConfigError, match="both name a teacher"):
        run_config(tiny_model_dir, tmp_path, **{"teacher.model.path": teacher_dir,
                                                 "trainer.algorithm.opd.teacher_path": teacher_dir})
    with pytest.raises(ConfigError, match="rollout.temperature = 1.0"):
        run_config(tiny_model_dir, tmp_path, **{"teacher.model.path": teacher_dir, "rollout.temperature": "0.7"})
    with pytest.raises(ConfigError, match="trainer.algorithm.name = 'opd'"):
        load_config(RunConfig, None, {"model.path": tiny_model_dir, "run.output_dir": str(tmp_path),
                                      "teacher.model.path": teacher_dir})
