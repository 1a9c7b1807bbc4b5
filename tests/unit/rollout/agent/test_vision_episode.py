"""Agent episodes of a vision-language model (tiny-qwen-vl; tiny-qwen3-vl for the episode and its
training) whose environment answers with a picture: the sequence holds every image's tokens as the
processor lays them out (TITO), every request sends the images so far, and the trainer's logprobs of
the episode equal the engine's."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from miles.buffer.types import PromptImage, SampleStatus
from miles.config.loader import build
from miles.data.chat import ChatFormat
from miles.data.prompts import Prompt
from miles.models.loading import load_tokenizer, load_vision
from miles.net import free_port
from miles.rollout.agent.episode import run_episode
from miles.rollout.config import AgentConfig
from miles.engine.process import EngineProcess
from miles.rollout.generate import GenerationError, SamplingParams
from miles.trainer.config import TrainerConfig
from miles.trainer.trainer import Trainer
from miles.trainer.types import TrainSequence
from tests.helpers.episodes import play_recorded
from tests.helpers.image_env import PictureEnv
from tests.helpers.images import png
from tests.helpers.scripted_engine import ScriptedEngine

TASK = "What do you see?"


# Each preset's checkpoint fixture (tests/conftest.py): Qwen2.5-VL, and Qwen3-VL, whose later image (the
# reply's, prefilled after the cached first turn) takes its deepstack features too.
PRESETS = {"tiny-qwen-vl": "tiny_vl_model_dir", "tiny-qwen3-vl": "tiny_qwen3_vl_model_dir"}


@pytest.fixture(scope="module", params=list(PRESETS))
def vl_dir(request) -> str:
    return request.getfixturevalue(PRESETS[request.param])


@pytest.fixture(scope="module")
def vl_engine_url(vl_dir):
    with EngineProcess(vl_dir) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _play(url, model_dir, env, prompt_images, seed=5, vision=True):
    return play_recorded(lambda client: run_episode(
        client, url, load_tokenizer(model_dir), env, Prompt(index=0, text=TASK, label="blue", images=prompt_images),
        SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed), AgentConfig(max_turns=4, max_response_tokens=400),
        rid="vl", vision=load_vision(model_dir) if vision else None))


@pytest.fixture(scope="module")
def episode(vl_engine_url, vl_dir):
    env = PictureEnv(turns=2)
    prompt_image = PromptImage.of(png("red", (48, 40), dot=(10, 10)))
    sample, exchanges = _play(vl_engine_url, vl_dir, env, (prompt_image,))
    return sample, exchanges, env, prompt_image


def test_an_episode_holds_and_sends_the_images_of_the_prompt_and_of_the_environments_reply(episode, vl_dir):
    sample, exchanges, env, prompt_image = episode
    vision, fmt = load_vision(vl_dir), ChatFormat(load_tokenizer(vl_dir))
    assert len(exchanges) == 2 and len(env.actions) == 2 and env.closed
    assert sample.status is SampleStatus.COMPLETED
    (_, first), (_, second) = exchanges
    shown = sample.images[1]
    assert sample.images == (prompt_image, shown) and shown != prompt_image

    # The prompt and the reply hold each image's tokens as the processor expands them (TITO).
    assert sample.prompt_ids == vision.expand(fmt.prompt_ids(TASK, 1), [vision.process(prompt_image.bytes())])
    turn1 = first["output_ids"]
    closed = turn1[-1] == fmt.end_id
    obs = vision.expand(fmt.observation_ids("Picture 1: which colour?", closed, 1), [vision.process(shown.bytes())])
    assert sample.response_ids == turn1 + obs + second["output_ids"]
    assert sample.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(second["output_ids"])
    assert obs.count(vision.image_token_id) == vision.process(shown.bytes()).num_tokens(vision.merge) > 1

    # Every request sends the images so far, in order, with one placeholder each (SGLang's wire form).
    for (request, _), n in zip(exchanges, (1, 2)):
        sent = sample.prompt_ids + (sample.response_ids[:len(turn1) + len(obs)] if n == 2 else [])
        assert request["image_data"] == [img.data for img in sample.images[:n]]
        assert request["input_ids"] == vision.collapse(sent)
        assert request["input_ids"].count(vision.image_token_id) == n


@pytest.mark.parametrize("pack", [False, True])
def test_trainer_logprobs_of_an_episode_with_a_picture_in_a_reply_equal_the_engines(
        episode, vl_dir, gloo, pack):
    sample = episode[0]
    text_only = TrainSequence(tokens=[1, 2, 3, 4, 5], prompt_len=3, loss_mask=[1, 1], old_logprobs=[0.0, 0.0])
    seq = TrainSequence(tokens=sample.prompt_ids + sample.response_ids, prompt_len=len(sample.prompt_ids),
                        loss_mask=sample.loss_mask, old_logprobs=sample.rollout_logprobs, images=sample.images)
    trainer = Trainer(build(TrainerConfig, {"micro_batch_size": 4, "pack_sequences": pack}), vl_dir, 0, 1,
                      "127.0.0.1", free_port())
    got, _ = trainer.proximal_logprobs([seq, text_only])
    trained = torch.tensor(sample.loss_mask, dtype=torch.bool)
    torch.testing.assert_close(torch.tensor(got)[trained], torch.tensor(sample.rollout_logprobs)[trained],
                               atol=1e-5, rtol=0)


def test_a_picture_for_a_model_without_a_vision_tower_is_refused(vl_engine_url, tiny_vl_model_dir):
    env = PictureEnv(turns=2)
    with pytest.raises(GenerationError, match="no vision tower"):
        _play(vl_engine_url, tiny_vl_model_dir, env, (), vision=False)
    assert env.closed


def test_an_episode_ends_after_the_model_samples_the_image_token(tiny_vl_model_dir):
    """Sent back, a sampled image token would read as one more image placeholder than there are images."""
    vision, fmt = load_vision(tiny_vl_model_dir), ChatFormat(load_tokenizer(tiny_vl_model_dir))
    engine = ScriptedEngine()
    engine.replies = [[5, vision.image_token_id, fmt.end_id], [6, fmt.end_id]]
    env = PictureEnv(turns=3)
    try:
        sample, _ = _play(engine.url, tiny_vl_model_dir, env, (PromptImage.of(png("red", (48, 40))),))
    finally:
        engine.stop()
    assert len(engine.requests) == 1 and len(env.actions) == 1 and env.closed
    assert sample.status is SampleStatus.TRUNCATED
    assert sample.response_ids == [5, vision.image_token_id, fmt.end_id] and len(sample.images) == 1


@pytest.mark.parametrize("form", ["bytes", "pil"])
def test_an_environment_may_give_its_pictures_as_bytes_or_pil_images(tiny_vl_model_dir, form):
    end = ChatFormat(load_tokenizer(tiny_vl_model_dir)).end_id
    samples = {}
    for f in ("prompt_image", form):
        engine = ScriptedEngine()
        engine.replies = [[40, end], [41, end]]  # plain text tokens
        try:
            samples[f], _ = _play(engine.url, tiny_vl_model_dir, PictureEnv(turns=2, form=f), ())
        finally:
            engine.stop()
    given, reference = samples[form], samples["prompt_image"]
    assert len(given.images) == 1 and given.response_ids == reference.response_ids  # the same image tokens
    if form == "bytes":
        assert given.images == reference.images
    else:  # re-encoded as PNG: the same pixels
        pixels = [Image.open(io.BytesIO(s.images[0].bytes())).convert("RGB").tobytes() for s in (given, reference)]
        assert pixels[0] == pixels[1]


def test_an_environments_picture_that_is_no_image_fails_the_episode_naming_it(tiny_vl_model_dir):
    engine, env = ScriptedEngine(), PictureEnv(turns=2, form="broken")
    engine.replies = [[40, ChatFormat(load_tokenizer(tiny_vl_model_dir)).end_id]]
    try:
        with pytest.raises(GenerationError, match="the environment's step observation.*cannot be read as an image"):
            _play(engine.url, tiny_vl_model_dir, env, ())
    finally:
        engine.stop()
    assert env.closed and len(engine.requests) == 1
