"""`miles bench rollout`'s raw decode loop, the ceiling the engine is measured against: it must decode
what the model decodes, or its speed says nothing."""

import pytest
import torch

from benchmarks import rollout as bench
from miles.models.loading import load_model, load_tokenizer
from miles.models.presets import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = build_tiny_model("tiny-qwen3", tmp_path_factory.mktemp("tiny"))
    return load_model(str(d)).eval(), load_tokenizer(str(d))


def test_raw_decode_with_its_shared_prefill_and_reserved_cache_decodes_what_generate_does(tiny, monkeypatch):
    model, tok = tiny
    # Of different lengths, so the left padding and the positions behind it are exercised.
    prompts = [tok.encode(t) for t in ("1+2=", "Question 7: 123+456=", "Question: 45+6=")]
    assert len({len(p) for p in prompts}) == 3
    drawn = []

    def argmax(probs, num_samples):  # greedy in place of the draw, so the result is comparable
        drawn.append(probs.argmax(-1, keepdim=True))
        return drawn[-1]

    monkeypatch.setattr(torch, "multinomial", argmax)
    wall, count = bench.run_raw_decode(model, prompts, 2, 6, tok.pad_token_id)
    assert count == 3 * 2 * 6 and wall > 0
    rows = torch.cat(drawn, dim=1)  # (6 samples, 6 tokens), prompt i's samples at 2i and 2i + 1
    monkeypatch.undo()
    for i, p in enumerate(prompts):
        want = model.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                              pad_token_id=tok.pad_token_id)[0, len(p):]
        assert rows[2 * i].tolist() == want.tolist() and rows[2 * i + 1].tolist() == want.tolist()
