"""Hybrid families served by the built-in engine: Qwen3-Next and Qwen3.5-MoE (gated delta-net layers)
and Nemotron-H (Mamba-2 blocks) keep a recurrent state per row, through continuous batching. Each
request's greedy ids equal transformers' own full-forward greedy of its prompt alone, while rows of
other lengths join the running batch and leave it mid-decode.

Logprobs: in float64 throughout, a batched row equals the same row decoded alone and transformers'
full forward (the trainer's form) to 1e-10, so batching, left padding, the states' merging and the
engine's decode steps compute the full forward's function. In float32, against the full forward,
batched rows included, every family holds 1e-5 (measured: Qwen3-Next 6.4e-6, Qwen3.5 4.5e-6; before
delta_step.py 1.1e-5 and 1.7e-5, held at 3e-5; docs/models.md). Each decode step is computed in the form the full forward takes at that
position: Nemotron-H's Mamba-2 step clamps the time step as the chunked form does (engine/mamba_step.py;
a row decoded alone equals transformers' cached decode to 1e-6); a gated delta-net layer runs the
chunked form over the row's current chunk from the state at its boundary (engine/delta_step.py;
prefilled and stepped, the layer equals transformers' layer over the whole sequence to 1e-6), where
transformers' cached decode, the recurrent form, is up to 1.9e-5 from its full forward. The delta-net
layers amplify float32 rounding (head outputs are sums that cancel, then normalised to unit scale), so
for these models the engine also keeps torch's kernels rounding as in a sequence's forward (linear
layers over a multiple of 4 rows, trailing zeros after convolutions and activations). Prefix reuse is
refused for them (the state after a prefix is not kept): a repeated prompt computes its whole prompt and
gives the same outputs. Routed experts recorded by the engine are the model's own choices."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from transformers import DynamicCache

from tests.unit.engine.test_engine_families import full_forward_greedy

HYBRID = ["tiny-qwen3-next", "tiny-qwen3-5-moe", "tiny-nemotron-h"]
DELTA_NET = ["tiny-qwen3-next", "tiny-qwen3-5-moe"]
GAP = 1e-5  # per-token logprob bound, float32, against transformers' full forward (see above)
PROMPTS = [list(range(3, 3 + n)) for n in (9, 21, 5, 14, 2)]


def cached_logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    """Logprobs of `ids` after `prompt` from transformers' cached decode: one forward over the prompt,
    then one token per forward on its cache (the recurrent-step form)."""
    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits
        for k, t in enumerate(ids):
            out.append(float(logits[0, -1].float().log_softmax(-1)[t]))
            logits = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True,
                           position_ids=torch.tensor([[len(prompt) + k]])).logits
    return out


def engine_step_model(path: str):
    """The model as the engine decodes it: transformers' own, with the engine's Mamba-2 step (mamba_step.py)."""
    from miles.engine import mamba_step
    from miles.models.loading import load_model

    model = load_model(path).eval()
    mamba_step.install(model)
    return model


def _row(rid: str, prompt: list[int], n: int, **kw):
    from miles.engine.row import Row
    from miles.engine_api.sampling import SamplingParams
    from miles.engine_api.types import GenerateRequest

    params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    return Row.of(GenerateRequest(rid=rid, input_ids=tuple(prompt), params=params, return_logprob=True, **kw), Future())


def join_and_leave(runner) -> list:
    """Two rows start; one leaves after 3 tokens (compacted out), two join mid-decode, and the last
    joins a batch whose other rows are many steps into their decode. Returns the rows, PROMPTS' order."""
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
    return [a, b, c, d, e]


def decode_alone(runner, prompt: list[int], n: int):
    """One row through the runner with no other row beside it; the batch is empty again after."""
    row = _row("alone", prompt, n)
    with torch.no_grad():
        runner.prefill([row])
        while row.finish is None:
            runner.decode()
        runner.retire_finished()
        runner.compact(force=True)
    return row


@pytest.mark.parametrize("preset", HYBRID)
def test_rows_joining_and_leaving_a_running_batch_match_transformers(preset, preset_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.model_runner import ModelRunner
    from miles.models.loading import load_model

    path = preset_dir(preset)
    hf = load_model(path).eval()
    stepped = engine_step_model(path)
    runner = ModelRunner(EngineConfig(model_path=path, fast_decode="off"))
    for row, prompt in zip(join_and_leave(runner), PROMPTS):
        ids, logprobs = full_forward_greedy(hf, prompt, row.req.params.max_new_tokens)
        assert row.output_ids == ids, row.req.rid
        if preset not in DELTA_NET:  # its decode step is transformers' recurrent one, clamped
            cached = cached_logprobs(stepped, prompt, ids)
            assert max(abs(x - y) for x, y in zip(row.logprobs, cached)) <= GAP, row.req.rid
        assert max(abs(x - y) for x, y in zip(row.logprobs, logprobs)) <= GAP, row.req.rid


@pytest.mark.parametrize("preset", HYBRID)
def test_in_float64_batched_rows_equal_rows_alone_and_the_full_forward(preset, preset_dir):
    """What the float32 bounds leave open: that batching, left padding, the states' merging and
    compaction, and the two forms (chunked prefill, recurrent decode) compute exactly the full forward's
    function. In float64 throughout, a batched row's logprobs equal the same row decoded alone and
    transformers' full forward to 1e-10 (float32 rounding is 1e-5 here, a padding or state slip more)."""
    from miles.engine.config import EngineConfig
    from miles.engine.model_runner import ModelRunner

    from tests.helpers.float64 import float32_casts_stay_float64, to_float64

    path = preset_dir(preset)
    full_model = to_float64(engine_step_model(path))
    runner = ModelRunner(EngineConfig(model_path=path, fast_decode="off"))
    to_float64(runner.model)
    with float32_casts_stay_float64():
        rows = join_and_leave(runner)
        for row, prompt in zip(rows, PROMPTS):
            alone = decode_alone(runner, prompt, row.req.params.max_new_tokens)
            assert alone.output_ids == row.output_ids, row.req.rid
            seq = prompt + row.output_ids
            with torch.no_grad():
                logits = full_model(input_ids=torch.tensor([seq])).logits[0]
            assert logits.dtype == torch.float64
            lp = logits.log_softmax(-1)
            full = [float(lp[t - 1, seq[t]]) for t in range(len(prompt), len(seq))]
            assert max(abs(x - y) for x, y in zip(row.logprobs, alone.logprobs)) <= 1e-10, row.req.rid
            assert max(abs(x - y) for x, y in zip(row.logprobs, full)) <= 1e-10, row.req.rid


@pytest.mark.parametrize("preset", ["tiny-nemotron-h"])
def test_a_row_decoded_alone_matches_transformers_cached_decode(preset, preset_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.model_runner import ModelRunner

    path = preset_dir(preset)
    runner = ModelRunner(EngineConfig(model_path=path, fast_decode="off"))
    row = _row("b", PROMPTS[1], 12)
    with torch.no_grad():
        runner.prefill([row])
        while row.finish is None:
            runner.decode()
    cached = cached_logprobs(engine_step_model(path), PROMPTS[1], row.output_ids)
    assert max(abs(x - y) for x, y in zip(row.logprobs, cached)) <= 1e-6


@pytest.mark.parametrize("preset", DELTA_NET)
def test_the_engines_delta_net_layer_equals_transformers_layer_over_each_whole_row(preset, preset_dir):
    """The engine's gated delta-net forward (delta_step.py) on a left-padded batch, prompts longer than a
    chunk (64 tokens) and of exactly one, then one token per step across chunk boundaries, against
    transformers' layer over each row's whole sequence alone: to 1e-6. Measured: equal but for the
    sequence's last few positions, which torch's kernels round their own way (3.6e-7)."""
    from transformers import DynamicCache

    from miles.engine import delta_step
    from miles.models.loading import load_model

    path = preset_dir(preset)
    theirs = next(m for m in load_model(path).eval().modules() if type(m).__name__ in delta_step.LAYERS.values())
    model = load_model(path).eval()
    assert delta_step.install(model) > 0
    ours = model.model.layers[theirs.layer_idx].linear_attn
    torch.manual_seed(0)
    lens, steps = [70, 64, 5], 62
    xs = [torch.randn(n + steps, model.config.hidden_size) for n in lens]
    S = max(lens)
    batch = torch.stack([torch.cat([x.new_zeros(S - n, x.shape[1]), x[:n]]) for x, n in zip(xs, lens)])
    mask = torch.tensor([[0] * (S - n) + [1] * n for n in lens])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        got = [[o] for o in ours(batch, cache=cache, attention_mask=mask)]
        for t in range(steps):
            step = ours(torch.stack([x[n + t] for x, n in zip(xs, lens)])[:, None], cache=cache)
            for r in range(len(lens)):
                got[r].append(step[r])
        for r, (x, n) in enumerate(zip(xs, lens)):
            want = theirs(x[None])[0]
            mine = torch.cat([got[r][0][S - n:], *got[r][1:]])
            assert (mine - want).abs().max() <= 1e-6, r


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
