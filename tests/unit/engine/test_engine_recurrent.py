"""Hybrid families served by the built-in engine: Qwen3-Next and Qwen3.5-MoE (gated delta-net layers)
and Nemotron-H (Mamba-2 blocks) keep a recurrent state per row, through continuous batching. Each
request's greedy ids equal transformers' own full-forward greedy of its prompt alone, while rows of
other lengths join the running batch and leave it mid-decode.

Logprobs: a row decoded alone equals transformers' own cached decode of its prompt (the same two
forms: the chunked scan over the prompt, then one recurrent step per token). Decoded in a batch of
other rows, the matmuls' shapes change and the delta rule carries that float32 rounding along:
up to 1.6e-5 on these presets, so the bound against transformers' cached decode is 3e-5. The two
forms also round differently from each other: transformers' cached decode is itself up to 1.1e-5
(Qwen3-Next) and 6.8e-5 (Nemotron-H) from its full forward, so against the full forward the engine is
held to that gap plus 3e-5. Prefix reuse is refused for them (the state after a prefix is not kept):
a repeated prompt computes its whole prompt and gives the same outputs. Routed experts recorded by
the engine are the model's own choices."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from transformers import DynamicCache

from tests.unit.engine.test_engine_families import full_forward_greedy

HYBRID = ["tiny-qwen3-next", "tiny-qwen3-5-moe", "tiny-nemotron-h"]
PROMPTS = [list(range(3, 3 + n)) for n in (9, 21, 5, 14, 2)]


def cached_logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    """Logprobs of `ids` after `prompt` from transformers' own cached decode: one forward over the
    prompt, then one token per forward on its cache (the recurrent-step form)."""
    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits
        for k, t in enumerate(ids):
            out.append(float(logits[0, -1].float().log_softmax(-1)[t]))
            logits = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True,
                           position_ids=torch.tensor([[len(prompt) + k]])).logits
    return out


def _row(rid: str, prompt: list[int], n: int, **kw):
    from miles.engine.row import Row
    from miles.engine_api.sampling import SamplingParams
    from miles.engine_api.types import GenerateRequest

    params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    return Row.of(GenerateRequest(rid=rid, input_ids=tuple(prompt), params=params, return_logprob=True, **kw), Future())


@pytest.mark.parametrize("preset", HYBRID)
def test_rows_joining_and_leaving_a_running_batch_match_transformers(preset, preset_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.model_runner import ModelRunner
    from miles.models.loading import load_model

    path = preset_dir(preset)
    hf = load_model(path).eval()
    runner = ModelRunner(EngineConfig(model_path=path, fast_decode="off"))
    # Two rows start; one leaves after 3 tokens (compacted out), two join mid-decode, and the last
    # joins a batch whose other rows are many steps into their decode.
    a, b = _row("a", PROMPTS[0], 3), _row("b", PROMPTS[1], 12)
    c, d = _row("c", PROMPTS[2], 10), _row("d", PROMPTS[3], 6)
    e = _row("e", PROMPTS[4], 5)
    with torch.no_grad():
        runner.prefill([a, b])
        for step in range(14):
            if step == 2:
                runner.prefill([c, d])  # joins rows whose states are 3 tokens in
            if step == 6:
                runner.prefill([e])
            if runner.rows:
                runner.decode()
            runner.retire_finished()
            runner.compact(force=True)  # drop finished rows now: every step after changes the batch
    for row, prompt in zip([a, b, c, d, e], PROMPTS):
        ids, logprobs = full_forward_greedy(hf, prompt, row.req.params.max_new_tokens)
        assert row.output_ids == ids, row.req.rid
        cached = cached_logprobs(hf, prompt, ids)
        assert max(abs(x - y) for x, y in zip(row.logprobs, cached)) <= 3e-5, row.req.rid
        own_gap = max(abs(x - y) for x, y in zip(cached, logprobs))
        assert max(abs(x - y) for x, y in zip(row.logprobs, logprobs)) <= own_gap + 3e-5, row.req.rid


@pytest.mark.parametrize("preset", HYBRID)
def test_a_row_decoded_alone_matches_transformers_cached_decode(preset, preset_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.model_runner import ModelRunner
    from miles.models.loading import load_model

    path = preset_dir(preset)
    hf = load_model(path).eval()
    runner = ModelRunner(EngineConfig(model_path=path, fast_decode="off"))
    row = _row("b", PROMPTS[1], 12)
    with torch.no_grad():
        runner.prefill([row])
        while row.finish is None:
            runner.decode()
    cached = cached_logprobs(hf, PROMPTS[1], row.output_ids)
    assert max(abs(x - y) for x, y in zip(row.logprobs, cached)) <= 1e-6


@pytest.mark.parametrize("preset", HYBRID)
def test_prefix_reuse_is_refused_and_a_repeated_prompt_computes_its_whole_prompt(preset, preset_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.engine import Engine
    from miles.engine_api.sampling import SamplingParams

    engine = Engine(EngineConfig(model_path=preset_dir(preset), prefix_block_size=4))
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        first = engine.generate(PROMPTS[1], params, return_logprob=True)
        again = engine.generate(PROMPTS[1], params, return_logprob=True)
        longer = engine.generate(PROMPTS[1] + first.output_ids + [7, 8], params, return_logprob=True)  # a next turn
        assert engine.runner.prefix_cache.max_tokens == 0
        assert (first.cached_tokens, again.cached_tokens, longer.cached_tokens) == (0, 0, 0)
        assert again.output_ids == first.output_ids and again.output_logprobs == first.output_logprobs
    finally:
        engine.stop()


@pytest.mark.parametrize("preset", HYBRID)
def test_routed_experts_are_the_models_own_choices(preset, preset_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.engine import Engine
    from miles.engine_api.sampling import SamplingParams
    from miles.models.loading import load_model
    from miles.models.moe import decode_routed_experts, hook_routers, moe_shape, routers

    path = preset_dir(preset)
    hf = load_model(path).eval()
    engine = Engine(EngineConfig(model_path=path))
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
        futures = [engine.submit(engine.make_request(p, params, return_routed_experts=True)) for p in PROMPTS[:3]]
        for prompt, f in zip(PROMPTS[:3], futures):
            out = f.result(120)
            layers, top_k = moe_shape(hf.config)
            seq = prompt + out.output_ids[:-1]  # the last token was never fed
            ids = []
            with torch.no_grad(), hook_routers(routers(hf), lambda _layer, o: ids.append(o[2])):
                hf(input_ids=torch.tensor([seq]))
            want = torch.stack(ids, dim=1).view(len(seq), layers, top_k)
            got = decode_routed_experts(out.routed_experts, layers, top_k)
            assert torch.equal(got.sort(-1).values, want.sort(-1).values.to(got.dtype))
    finally:
        engine.stop()


@pytest.mark.parametrize("preset", HYBRID)
def test_retracted_rows_come_back_and_continue_as_transformers_would(preset, preset_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.model_runner import ModelRunner
    from miles.models.loading import load_model

    path = preset_dir(preset)
    hf = load_model(path).eval()
    runner = ModelRunner(EngineConfig(model_path=path, fast_decode="off"))
    rows = [_row(str(i), p, 8) for i, p in enumerate(PROMPTS[:3])]
    with torch.no_grad():
        runner.prefill(rows)
        for _ in range(3):
            runner.decode()
        back = runner.retract()  # a pause: no state survives; the rows recompute prompt + output so far
        assert back == rows and not runner.rows
        runner.prefill(back)
        while any(r.finish is None for r in runner.rows):
            runner.decode()
    for row, prompt in zip(rows, PROMPTS):
        assert row.output_ids == full_forward_greedy(hf, prompt, 8)[0], row.req.rid


def test_the_fast_decode_path_leaves_hybrid_models_to_the_eager_path_with_the_reason_logged(preset_dir, caplog):
    from miles.engine.config import EngineConfig
    from miles.engine.model_runner import ModelRunner

    with caplog.at_level("WARNING"):
        runner = ModelRunner(EngineConfig(model_path=preset_dir("tiny-qwen3-next"), fast_decode="on"))
    assert runner.decoder is None
    assert "fast_decode: model type 'qwen3_next' is not one of" in caplog.text


@pytest.mark.parametrize("preset", HYBRID)
def test_each_rows_recurrent_state_is_counted_in_the_kv_budget(preset, preset_dir):
    from miles.engine import kv_cache, recurrent_state
    from miles.engine.config import EngineConfig
    from miles.engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model_path=preset_dir(preset), fast_decode="off"))
    rows = [_row(str(i), p, 4) for i, p in enumerate(PROMPTS[:3])]
    with torch.no_grad():
        runner.prefill(rows)
    held = recurrent_state.state_bytes(runner.kv.cache)
    # What the running batch really holds per row is what admission reserves for it, to a token.
    per_token = kv_cache.bytes_per_token(runner.model)
    assert runner.state_tokens > 0
    assert (runner.state_tokens - 1) * per_token < held / len(rows) <= runner.state_tokens * per_token
