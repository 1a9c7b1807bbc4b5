"""Short RL runs of a vision-language model (tiny-qwen-vl; tiny-qwen3-vl on one layout) on rows with
images in each layout users bring, over a real local Ray cluster: the images reach the engines and the trainer, weights (vision
tower included) sync and verify, and the final checkpoint is a loadable vision-language directory;
and agent episodes whose environment answers with pictures."""

import json

import datasets
import pytest

from tests.helpers.images import png
from tests.helpers.runs import small_config

pytestmark = pytest.mark.e2e

COLOURS = ["red", "blue", "green", "white", "black", "yellow"]


def _verl(tmp_path):
    rows = [{"data_source": "colours", "reward_model": {"style": "rule", "ground_truth": c},
             "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
             "images": [{"bytes": png(c), "path": None}]} for c in COLOURS * 2]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    return {"rollout.task.data.layout": "verl", "rollout.task.data.path": str(tmp_path / "train.parquet")}


def _trl_conversational_paths(tmp_path):
    rows = []
    for i, c in enumerate(COLOURS * 2):
        (tmp_path / f"{i}.png").write_bytes(png(c))
        rows.append({"prompt": [{"role": "user", "content": "Colour?"}], "images": [f"{i}.png"], "solution": c})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"rollout.task.data.layout": "trl", "rollout.task.data.path": str(tmp_path / "train.jsonl"),
            "rollout.task.data.label_key": "solution"}


def _trl_image_feature(tmp_path):
    from PIL import Image
    import io

    ds = datasets.Dataset.from_dict({"prompt": ["Colour?"] * 12, "solution": COLOURS * 2,
                                     "image": [Image.open(io.BytesIO(png(c))) for c in COLOURS * 2]})
    ds.cast_column("image", datasets.Image()).save_to_disk(str(tmp_path / "ds"))
    return {"rollout.task.data.layout": "trl", "rollout.task.data.path": str(tmp_path / "ds"),
            "rollout.task.data.label_key": "solution"}


# preset -> (its checkpoint fixture in tests/conftest.py, the class name its final checkpoint loads as)
PRESETS = {"tiny-qwen-vl": ("tiny_vl_model_dir", "Qwen2_5_VL"), "tiny-qwen3-vl": ("tiny_qwen3_vl_model_dir", "Qwen3VL")}


@pytest.mark.parametrize("preset, layout", [("tiny-qwen-vl", _verl), ("tiny-qwen-vl", _trl_conversational_paths),
                                            ("tiny-qwen-vl", _trl_image_feature), ("tiny-qwen3-vl", _verl)])
def test_two_steps_on_rows_with_images(request, tmp_path, ray_cluster, preset, layout):
    from miles.models.loading import load_model, load_vision
    from miles.orchestration.driver import run_train

    fixture, model_class = PRESETS[preset]
    model_dir = request.getfixturevalue(fixture)
    summary = run_train(small_config(model_dir, tmp_path, **{
        "loop.num_steps": "2", "eval.every_steps": "2", "eval.num_prompts": "2", "rollout.task.name": "dataset",
        # A tiny untrained model scores 0 everywhere: keep its zero-advantage groups so steps train.
        "rollout.task.data.eval_fraction": "0.2", "buffer.filter": "none", **layout(tmp_path),
        # The rows' longest label is 6 tokens: room for it, as the label check asks.
        "rollout.max_new_tokens": "6", "eval.max_new_tokens": "6"}))
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["step"] > 0]
    assert all(r["buffer/samples_trained"] > 0 and r["train/loss_tokens"] > 0 for r in trained)
    # Every tensor, the vision tower's too, was pushed and verified against the trainer.
    n_tensors = len(dict(load_model(model_dir).named_parameters()))  # tied weights once
    assert trained[0]["sync/verified_tensors"] == n_tensors
    final = summary["final_checkpoint"]
    assert load_vision(final) is not None and type(load_model(final)).__name__.startswith(model_class)


def test_two_agent_steps_with_an_environment_that_answers_with_pictures(tiny_vl_model_dir, tmp_path, ray_cluster):
    from miles.data.chat import ChatFormat
    from miles.models.loading import load_tokenizer
    from miles.orchestration.driver import run_train

    summary = run_train(small_config(tiny_vl_model_dir, tmp_path, **{
        "loop.num_steps": "2", "eval.every_steps": "2", "eval.num_prompts": "2", "rollout.task.name": "dataset",
        "rollout.task.data.eval_fraction": "0.2", "buffer.filter": "none", **_verl(tmp_path),
        "rollout.generate_fn": "agent", "rollout.agent.environment": "tests.helpers.image_env:picture_env",
        "rollout.agent.max_turns": "2", "rollout.agent.max_response_tokens": "120", "rollout.max_new_tokens": "4"}))
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["step"] > 0]
    assert all(r["buffer/samples_trained"] > 0 and r["train/loss_tokens"] > 0 for r in trained)
    # Without its picture a response is at most 2 x 4 model tokens and the reply's text (closing the turn).
    fmt = ChatFormat(load_tokenizer(tiny_vl_model_dir))
    without_picture = 2 * 4 + len(fmt.observation_ids("Picture 1: which colour?", closed=False))
    assert all(r["rollout/response_len_mean"] > without_picture for r in trained)
