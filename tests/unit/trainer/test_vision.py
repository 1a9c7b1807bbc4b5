"""A vision-language policy (tiny-qwen-vl; tiny-qwen3-vl, whose tower also feeds deepstack features
into the first decoder layers) in the trainer: its logprobs of sampled responses to prompts with
images equal the engine's (the same pixel values, image-token layout and 3-D positions, padded or
packed, beside text-only rows), and its vision tower trains only when asked to."""

from __future__ import annotations

import pytest
import torch

from miles.buffer.types import PromptImage
from miles.config.loader import build
from miles.engine_api.sampling import SamplingParams
from miles.models.loading import load_tokenizer, load_vision
from miles.net import free_port
from miles.trainer.config import TrainerConfig
from miles.trainer.trainer import Trainer
from miles.trainer.types import BatchTotals, TrainSequence
from tests.helpers.images import png


# Each preset's checkpoint fixture (tests/conftest.py).
PRESETS = {"tiny-qwen-vl": "tiny_vl_model_dir", "tiny-qwen3-vl": "tiny_qwen3_vl_model_dir"}


@pytest.fixture(scope="module")
def sampled():
    """sampled(model_dir): `_sample`'s sequences, once per checkpoint."""
    done: dict[str, list[TrainSequence]] = {}

    def get(model_dir: str) -> list[TrainSequence]:
        if model_dir not in done:
            done[model_dir] = _sample(model_dir)
        return done[model_dir]
    return get


@pytest.fixture(scope="module")
def rollouts(tiny_vl_model_dir, sampled) -> list[TrainSequence]:
    return sampled(tiny_vl_model_dir)


def _sample(model_dir: str) -> list[TrainSequence]:
    """Sequences sampled by the built-in engine: one image, two images of different sizes, text only."""
    from miles.engine.config import EngineConfig
    from miles.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=model_dir))
    tok, vision = load_tokenizer(model_dir), load_vision(model_dir)
    seqs = []
    try:
        for k, (colour, n) in enumerate([("red", 1), ("blue", 2), (None, 0)]):
            content = [{"type": "image"}] * n + [{"type": "text", "text": "What colour?"}]
            text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
            ids = tok(text, add_special_tokens=False).input_ids
            images = tuple(PromptImage.of(png(colour, (48 + 16 * j, 40), dot=(10, 10))) for j in range(n))
            req = engine.make_request(ids, SamplingParams(temperature=1.0, max_new_tokens=8, seed=k), True,
                                      image_data=[i.data for i in images])
            out = engine.submit(req).result(120)
            prompt = vision.expand(ids, [vision.process(i.bytes()) for i in images]) if images else ids
            seqs.append(TrainSequence(tokens=prompt + out.output_ids, prompt_len=len(prompt),
                                      loss_mask=[1] * len(out.output_ids), old_logprobs=out.output_logprobs,
                                      advantage=1.0 - k, images=images))
    finally:
        engine.stop()
    return seqs


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_trainer_logprobs_equal_the_engines_on_prompts_with_images(request, gloo, sampled, preset, pack):
    model_dir = request.getfixturevalue(PRESETS[preset])
    rollouts = sampled(model_dir)
    trainer = Trainer(build(TrainerConfig, {"micro_batch_size": 4, "pack_sequences": pack}), model_dir, 0, 1,
                      "127.0.0.1", free_port())
    for seq, logprobs in zip(rollouts, trainer.proximal_logprobs(rollouts)):
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(seq.old_logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("train_tower", [False, True])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_vision_tower_trains_only_when_asked(request, gloo, sampled, preset, train_tower):
    """Qwen3-VL's deepstack mergers are part of the tower: they learn through the decoder layers
    their features are added to, and only when the tower trains."""
    model_dir = request.getfixturevalue(PRESETS[preset])
    rollouts = sampled(model_dir)
    trainer = Trainer(build(TrainerConfig, {"micro_batch_size": 4, "lr": 1e-2, "train_vision_tower": train_tower}),
                      model_dir, 0, 1, "127.0.0.1", free_port())
    before = {n: t.clone() for n, t in trainer.full_named_tensors(all_ranks=True)}
    trainer.train_step(rollouts, BatchTotals.of(rollouts))
    after = dict(trainer.full_named_tensors(all_ranks=True))
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    tower = {n for n in before if n.startswith("model.visual.")}
    assert tower and changed - tower  # the language model learned
    assert (tower <= changed) if train_tower else not (tower & changed)
    if preset == "tiny-qwen3-vl":
        assert any(".deepstack_merger_list." in n for n in tower)


def test_a_sampled_image_token_is_text_in_training_as_in_the_engine(tiny_vl_model_dir, gloo, rollouts):
    """A response may hold the image token itself; the engine feeds it back as text, so must the
    trainer (it is no image: the model's own forward would take it for one and fail)."""
    from miles.engine.config import EngineConfig
    from miles.engine.engine import Engine

    vision = load_vision(tiny_vl_model_dir)
    seq = rollouts[0]
    prompt = seq.tokens[:seq.prompt_len]
    engine = Engine(EngineConfig(model_path=tiny_vl_model_dir))
    try:  # near-uniform sampling over 400 tokens: some of these 24 x 64 draws are the image token
        futures = [engine.submit(engine.make_request(prompt, SamplingParams(temperature=5.0, max_new_tokens=64, seed=k),
                                                     True, image_data=[i.data for i in seq.images]))
                   for k in range(24)]
        outs = [f.result(300) for f in futures]
    finally:
        engine.stop()
    hit = next(o for o in outs if vision.image_token_id in o.output_ids)
    sampled = TrainSequence(tokens=prompt + hit.output_ids, prompt_len=len(prompt), loss_mask=[1] * len(hit.output_ids),
                            old_logprobs=hit.output_logprobs, images=seq.images)
    trainer = Trainer(build(TrainerConfig, {"micro_batch_size": 4}), tiny_vl_model_dir, 0, 1, "127.0.0.1", free_port(),
                      temperature=5.0)
    (got,) = trainer.proximal_logprobs([sampled])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(hit.output_logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("over", [{"lora": {"rank": 4}}, {"quantization": "fp8"}])
def test_lora_and_quantized_training_of_a_vision_language_policy_are_refused(tiny_vl_model_dir, over):
    from miles.trainer.backends.loading import load_policy

    with pytest.raises(ValueError, match="not supported for a vision-language policy"):
        load_policy(build(TrainerConfig, over), tiny_vl_model_dir, torch.device("cpu"))
