"""Vision-language models (tiny-qwen-vl, Qwen2.5-VL; tiny-qwen3-vl, Qwen3-VL with deepstack features)
served by the built-in engine over HTTP: images sent as SGLang sends them (`image_data` on /generate,
image parts on /v1/chat/completions) give the logprobs transformers' own forward gives on the
processor's inputs; the prefix cache reuses an image's KV for the same pixels only; bad image requests
are refused naming the field."""

from __future__ import annotations

import base64

import httpx
import pytest
import torch

from miles.models.loading import load_model, load_tokenizer, load_vision
from tests.helpers.images import png

RED, BLUE = png("red", (48, 40), dot=(10, 10)), png("blue", (48, 40), dot=(30, 20))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# Each preset's checkpoint fixture (tests/conftest.py).
PRESETS = {"tiny-qwen-vl": "tiny_vl_model_dir", "tiny-qwen3-vl": "tiny_qwen3_vl_model_dir"}


@pytest.fixture(scope="module", params=list(PRESETS))
def vl_dir(request) -> str:
    return request.getfixturevalue(PRESETS[request.param])


@pytest.fixture(scope="module")
def vl(vl_dir):
    from miles.engine.process import EngineProcess

    with EngineProcess(vl_dir) as proc, httpx.Client(base_url=proc.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def parts(vl_dir):
    tok, vision = load_tokenizer(vl_dir), load_vision(vl_dir)
    model = load_model(vl_dir).eval()

    def prompt(n_images: int = 1, text: str = "What colour is it?") -> list[int]:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        rendered = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
        return tok(rendered, add_special_tokens=False).input_ids

    def hf_logprobs(ids: list[int], images: list[bytes], out: list[int], temperature: float = 1.0):
        """transformers' forward on the processor's inputs (it computes the 3-D positions itself)."""
        inputs = [vision.process(b) for b in images]
        full = torch.tensor([vision.expand(ids, inputs) + out])
        with torch.no_grad():
            logits = model(input_ids=full, pixel_values=torch.cat([i.pixel_values for i in inputs]),
                           image_grid_thw=torch.tensor([i.grid for i in inputs]),
                           mm_token_type_ids=(full == vision.image_token_id).long()).logits[0].float()
        lp = torch.log_softmax(logits[:-1] / (temperature or 1.0), -1).gather(1, full[0, 1:, None])[:, 0]
        return lp[-len(out):]

    return prompt, hf_logprobs, vision


def _generate(client, ids, images, **sp):
    body = {"input_ids": ids, "image_data": [b64(i) for i in images], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, **sp}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return out, torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


@pytest.mark.parametrize("images, sp", [([RED], {}), ([RED, BLUE], {"temperature": 1.0, "sampling_seed": 3})])
def test_logprobs_equal_transformers_forward_on_the_processors_inputs(vl, parts, images, sp):
    prompt, hf_logprobs, vision = parts
    ids = prompt(len(images))
    out, lps = _generate(vl, ids, images, **sp)
    torch.testing.assert_close(lps, hf_logprobs(ids, images, out["output_ids"], sp.get("temperature", 0)),
                               atol=1e-5, rtol=0)
    expanded = vision.expand(ids, [vision.process(b) for b in images])
    assert out["meta_info"]["prompt_tokens"] == len(expanded) > len(ids)


def test_the_image_changes_the_answer_and_pre_expanded_ids_give_the_same(vl, parts):
    prompt, _, vision = parts
    ids = prompt()
    red, _ = _generate(vl, ids, [RED])
    blue, _ = _generate(vl, ids, [BLUE])
    assert red["output_ids"] != blue["output_ids"]
    # The ids miles records (each placeholder already expanded) are taken as they are.
    same, _ = _generate(vl, vision.expand(ids, [vision.process(RED)]), [RED])
    assert same["output_ids"] == red["output_ids"]


def test_prefix_cache_shares_kv_between_identical_pixels_only(vl, parts):
    prompt, _, _ = parts
    ids = prompt(text="Which colour do you see here, exactly?")
    vl.post("/flush_cache")
    first, _ = _generate(vl, ids, [RED])
    again, _ = _generate(vl, ids, [RED])
    other, _ = _generate(vl, ids, [BLUE])
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] > 6 and again["output_ids"] == first["output_ids"]
    image_at = ids.index(parts[2].image_token_id)
    # The blue image shares only what comes before any image token; its own tokens are computed.
    assert other["meta_info"]["cached_tokens"] <= image_at


def test_a_cached_prefix_ending_inside_an_image_gives_the_forwards_logprobs(vl, parts):
    """The computed suffix starts inside an image: its remaining tokens get their embeddings (and
    Qwen3-VL's deepstack features) by their index in the image, at the image's 3-D positions."""
    prompt, hf_logprobs, vision = parts
    vl.post("/flush_cache")
    _generate(vl, prompt(2, "What colour is it?"), [RED, BLUE])
    ids = prompt(2, "Which colour do you see here, exactly?")
    out, lps = _generate(vl, ids, [RED, BLUE])
    runs = vision.runs(vision.expand(ids, [vision.process(b) for b in (RED, BLUE)]))
    assert any(a < out["meta_info"]["cached_tokens"] < b for a, b in runs), (runs, out["meta_info"])
    torch.testing.assert_close(lps, hf_logprobs(ids, [RED, BLUE], out["output_ids"]), atol=1e-5, rtol=0)


def test_batched_image_data_is_one_list_per_prompt(vl, parts):
    prompt, _, _ = parts
    ids = prompt()
    body = {"input_ids": [ids, ids, prompt(2)], "image_data": [b64(RED), [b64(BLUE)], [b64(RED), b64(BLUE)]],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    r = vl.post("/generate", json=body)
    assert r.status_code == 200, r.text
    outs = [o["output_ids"] for o in r.json()]
    assert outs[0] == _generate(vl, ids, [RED])[0]["output_ids"]
    assert outs[1] == _generate(vl, ids, [BLUE])[0]["output_ids"]
    assert outs[2] == _generate(vl, prompt(2), [RED, BLUE])[0]["output_ids"]


def test_chat_completions_take_image_parts_as_sglang_does(vl, parts):
    prompt, _, _ = parts
    tok_ids = prompt()
    want, _ = _generate(vl, tok_ids, [RED], max_new_tokens=6)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(RED)}},
        {"type": "text", "text": "What colour is it?"}]}]
    r = vl.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want["text"]


@pytest.mark.parametrize("images, why", [
    (["bm90IGFuIGltYWdl"], "image_data: the image cannot be read as an image"),
    (["%%%"], "image_data: not valid base64"),
    (["https://example.com/cat.png"], "takes images inline"),
    ([b64(RED), b64(BLUE)], "1 image placeholders (token"),
])
def test_bad_image_requests_are_refused_naming_the_field(vl, parts, images, why):
    r = vl.post("/generate", json={"input_ids": parts[0](), "image_data": images,
                                   "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and why in r.text, r.text
    assert vl.get("/health").status_code == 200


def test_videos_are_refused_naming_the_field(vl, parts):
    body = {"input_ids": parts[0](), "video_data": [b64(RED)], "sampling_params": {"max_new_tokens": 2}}
    r = vl.post("/generate", json=body)
    assert r.status_code == 400 and "video_data: the built-in engine serves images only" in r.text, r.text


def test_a_text_model_refuses_image_data(client, tokenizer):
    r = client.post("/generate", json={"input_ids": tokenizer.encode("1+1="), "image_data": [b64(RED)]})
    assert r.status_code == 400 and "this model has no vision tower" in r.text, r.text


def test_features_that_cannot_serve_a_vision_language_model_are_refused_by_name(tiny_vl_model_dir, tmp_path):
    from miles.engine_api.errors import InvalidRequest
    from miles.engine.config import EngineConfig
    from miles.engine.engine import Engine

    with pytest.raises(ValueError, match=r"rollout.engine.quantization = 'fp8' is not supported for a vision-language"):
        Engine(EngineConfig(model_path=tiny_vl_model_dir, quantization="fp8"))
    engine = Engine(EngineConfig(model_path=tiny_vl_model_dir))
    try:
        with pytest.raises(InvalidRequest, match="LoRA adapters are not supported on a vision-language model"):
            engine.load_lora_adapter("a", str(tmp_path))
    finally:
        engine.stop()
