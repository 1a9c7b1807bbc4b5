"""The engine's fast decode (static KV cache, decode forward over it, sampling on the device) answers
exactly as its eager path: the same greedy ids and seeded samples, logprobs within float tolerance,
with requests joining and leaving a running batch, the prefix cache, streaming, input logprobs, LoRA,
routed experts, quantized serving, weight updates and memory release all still served, on every model
family it supports; a KV budget too short for every row's context serves a shorter context and says so."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from miles.devices import total_memory
from miles.engine_api.errors import InvalidRequest
from miles.engine_api.sampling import SamplingParams
from miles.models.loading import load_model
from miles.engine import kv_cache
from miles.engine.config import EngineConfig
from miles.engine.engine import Engine
from miles.engine.lora import read_adapter
from miles.engine.static_kv import StaticKV
from tests.unit.engine.test_engine_lora import _write_adapter
from tests.unit.engine.test_engine_models import _build

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], list(range(20, 90)), [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def _engine(model_dir, fast: bool, **over) -> Engine:
    cfg = EngineConfig(model_path=model_dir, fast_decode="on" if fast else "off",
                       **{"max_batch_size": 8, "prefix_block_size": 4, **over})
    engine = Engine(cfg)
    assert isinstance(engine.runner.kv, StaticKV) == fast
    return engine


def _run(engine: Engine, requests, stagger: float = 0.0):
    """Submit each (prompt, params, extra kwargs) `stagger` seconds apart; results in order."""
    def one(i):
        time.sleep(stagger * i)
        prompt, params, kw = requests[i]
        return engine.submit(engine.make_request(prompt, params, return_logprob=True, **kw)).result(120)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, range(len(requests))))


def _both(model_dir, requests, stagger=0.0, **over):
    outs = []
    for fast in (False, True):
        engine = _engine(model_dir, fast, **over)
        try:
            outs.append(_run(engine, requests, stagger))
        finally:
            engine.stop()
    return outs


def _assert_same(eager, fast, atol=1e-4):
    for a, b in zip(eager, fast):
        assert b.output_ids == a.output_ids
        assert b.finish_reason == a.finish_reason
        torch.testing.assert_close(torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs), atol=atol, rtol=0)


def test_greedy_ids_and_logprobs_equal_the_eager_path_as_rows_join_and_leave(model_dir):
    budgets = [40, 12, 25, 6, 33]
    reqs = [(p, SamplingParams(temperature=0, max_new_tokens=n), {}) for p, n in zip(PROMPTS, budgets)]
    eager, fast = _both(model_dir, reqs, stagger=0.02)
    _assert_same(eager, fast)
    assert any(len(o.output_ids) > 10 for o in fast)


def test_seeded_sampling_with_truncation_draws_the_same_tokens(model_dir):
    params = [SamplingParams(temperature=0.8, top_k=5, max_new_tokens=20, seed=1),
              SamplingParams(temperature=1.0, top_p=0.7, max_new_tokens=20, seed=2),
              SamplingParams(temperature=0, max_new_tokens=20),
              SamplingParams(temperature=1.2, min_p=0.1, max_new_tokens=20, seed=3)]
    eager, fast = _both(model_dir, [(p, s, {}) for p, s in zip(PROMPTS, params)])
    _assert_same(eager, fast)


def test_prefix_cache_streaming_and_input_logprobs_still_served(model_dir):
    shared = PROMPTS[2]
    outs = []
    for fast in (False, True):
        engine = _engine(model_dir, fast)
        try:
            first = _run(engine, [(shared + [7], SamplingParams(temperature=0, max_new_tokens=8), {})])[0]
            streamed: list[int] = []
            req = engine.make_request(shared + [8], SamplingParams(temperature=0, max_new_tokens=8),
                                      return_logprob=True, logprob_start_len=60)
            second = engine.submit(req, listener=lambda ids, lps: streamed.extend(ids)).result(120)
            assert streamed == second.output_ids
            outs.append((first, second))
        finally:
            engine.stop()
    (e1, e2), (f1, f2) = outs
    _assert_same([e1, e2], [f1, f2])
    assert f2.cached_tokens > 0  # the second prompt read the first one's KV, written from the static cache
    ids_e, lps_e = e2.input_logprobs
    ids_f, lps_f = f2.input_logprobs
    assert ids_f == ids_e
    torch.testing.assert_close(torch.tensor(lps_f[1:]), torch.tensor(lps_e[1:]), atol=1e-4, rtol=0)


def test_lora_adapter_rows_decode_on_their_adapter(model_dir, tmp_path):
    _write_adapter(model_dir, tmp_path / "a")
    outs = []
    for fast in (False, True):
        engine = _engine(model_dir, fast)
        try:
            with engine.model_lock:
                engine.runner.adapters.add(read_adapter("a", str(tmp_path / "a"), engine.model))
            reqs = [(p, SamplingParams(temperature=0, max_new_tokens=12), {"lora_path": "a" if i % 2 else None})
                    for i, p in enumerate(PROMPTS[:4])]
            outs.append(_run(engine, reqs))
        finally:
            engine.stop()
    _assert_same(*outs)


def test_routed_experts_are_recorded_on_the_fast_path(tiny_moe_model_dir):
    reqs = [(p, SamplingParams(temperature=0, max_new_tokens=6), {"return_routed_experts": True}) for p in PROMPTS[:3]]
    eager, fast = _both(tiny_moe_model_dir, reqs)
    _assert_same(eager, fast)
    for a, b in zip(eager, fast):
        assert b.routed_experts and b.routed_experts == a.routed_experts


def test_memory_release_frees_the_static_cache_and_decoding_resumes(model_dir):
    engine = _engine(model_dir, True)
    try:
        reqs = [(p, SamplingParams(temperature=0, max_new_tokens=10), {}) for p in PROMPTS[:2]]
        before = _run(engine, reqs)
        engine.release_memory(("kv_cache",))
        assert not engine.runner.kv.allocated
        engine.resume_memory(("kv_cache",))
        after = _run(engine, reqs)
        _assert_same(before, after, atol=1e-5)
    finally:
        engine.stop()


def test_a_short_kv_budget_serves_a_shorter_context_and_refuses_longer_prompts(model_dir):
    model = load_model(model_dir)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    slots, per_row = 4, 200
    fraction = (weights + slots * per_row * kv_cache.bytes_per_token(model)) / total_memory("cpu")
    engine = _engine(model_dir, True, max_batch_size=slots, memory_fraction=fraction, prefix_cache=False)
    try:
        assert engine.context_length == engine.runner.kv.cap < model.config.max_position_embeddings
        with pytest.raises(InvalidRequest, match="context length"):
            engine.make_request(list(range(3, 3 + engine.context_length)))
        out = _run(engine, [([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=engine.context_length,
                                                       ignore_eos=True), {})])[0]
        assert out.finish_reason.type == "length" and len(out.output_ids) == engine.context_length - 3
    finally:
        engine.stop()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3_moe"])
def test_every_supported_family_decodes_as_on_the_eager_path(arch, tmp_path, tiny_model_dir):
    path = _build(arch, tmp_path / arch, tiny_model_dir)
    reqs = [(p, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True), {}) for p in PROMPTS[:4]]
    eager, fast = _both(path, reqs)
    _assert_same(eager, fast)


def test_quantized_serving_decodes_as_on_the_eager_path(model_dir):
    reqs = [(p, SamplingParams(temperature=1.0, max_new_tokens=12, seed=i), {}) for i, p in enumerate(PROMPTS[:3])]
    eager, fast = _both(model_dir, reqs, quantization="fp8")
    _assert_same(eager, fast)


def test_a_weight_update_between_steps_is_decoded_with_on_both_paths(model_dir):
    outs = []
    for fast in (False, True):
        engine = _engine(model_dir, fast)
        try:
            name = next(n for n in engine.param_meta if n.endswith("layers.0.mlp.down_proj.weight"))
            new = engine.model.state_dict()[name].detach().clone() * 1.5
            engine.apply_weights({name: new}, "v2", adopt={name})
            outs.append(_run(engine, [(p, SamplingParams(temperature=0, max_new_tokens=10), {}) for p in PROMPTS[:3]]))
        finally:
            engine.stop()
    _assert_same(*outs)
    assert all(o.weight_version == "v2" for o in outs[1])


def test_a_long_prompt_is_prefilled_in_chunks_while_the_batch_keeps_decoding(model_dir):
    long_prompt = PROMPTS[2] + PROMPTS[4]  # 81 tokens: 6 chunks of 16
    short = (PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    outs = []
    for fast in (False, True):
        engine = _engine(model_dir, fast, prefill_chunk_tokens=16)
        try:
            during: list[bool] = []  # per streamed step of the short row: was the long prompt being chunked?
            queued = threading.Event()

            def listener(ids, lps):
                during.append(bool(engine.runner.chunking))
                if len(during) == 1:  # the scheduler waits here, after the short row's prefill, for the long prompt
                    queued.wait(60)

            first = engine.submit(engine.make_request(*short, return_logprob=True), listener=listener)
            while not during:
                time.sleep(0.001)
            before = engine.stats["prefill_forwards"]
            pending = engine.submit(engine.make_request(long_prompt, SamplingParams(temperature=0, max_new_tokens=12),
                                                        return_logprob=True))
            queued.set()
            long_out = pending.result(120)
            prefills = engine.stats["prefill_forwards"] - before
            again = _run(engine, [(long_prompt, SamplingParams(temperature=0, max_new_tokens=12), {})])[0]
            outs.append((first.result(60), long_out, again, prefills, any(during)))
        finally:
            engine.stop()
    (e_short, e_long, e_again, e_prefills, _), (f_short, f_long, f_again, f_prefills, interleaved) = outs
    _assert_same([e_short, e_long, e_again], [f_short, f_long, f_again])
    assert e_prefills == 1 and f_prefills == 6  # whole on the eager path; ceil(81 / 16) chunks on the fast one
    assert interleaved  # the short row got tokens while the long prompt was being prefilled
    assert f_again.cached_tokens > 0  # the chunked prompt's KV went to the prefix cache


def test_a_chunking_row_can_be_aborted_or_retracted(model_dir):
    from concurrent.futures import Future

    from miles.engine_api.types import GenerateRequest
    from miles.engine.model_runner import ModelRunner
    from miles.engine.row import Row

    runner = ModelRunner(EngineConfig(model_path=model_dir, fast_decode="on", max_batch_size=4, prefill_chunk_tokens=8))

    def row(rid):
        return Row.of(GenerateRequest(rid=rid, input_ids=tuple(PROMPTS[2]), params=SamplingParams(
            temperature=0, max_new_tokens=5)), Future())

    a, b = row("a"), row("b")
    runner.prefill([a, b])
    assert runner.chunking == [a, b] and runner.num_running == 2 and not runner.rows
    runner.prefill_chunk()
    runner.abort({"a"})
    assert runner.retire_finished() == [a] and a.finish.type == "abort"
    runner.prefill_chunk()
    assert runner.retract() == [b] and not runner.chunking
    runner.prefill([b])
    while runner.chunking:
        runner.prefill_chunk()
    assert runner.rows == [b] and len(b.output_ids) == 1


def test_a_chunked_row_joins_a_full_batch_once_its_retired_rows_are_dropped(model_dir):
    from concurrent.futures import Future

    from miles.engine_api.types import GenerateRequest
    from miles.engine.model_runner import ModelRunner
    from miles.engine.row import Row

    runner = ModelRunner(EngineConfig(model_path=model_dir, fast_decode="on", max_batch_size=2, prefill_chunk_tokens=8))
    asks = [(PROMPTS[0], 1), (PROMPTS[1], 9), (PROMPTS[2], 4)]
    rows = [Row.of(GenerateRequest(rid=str(i), input_ids=tuple(p), params=SamplingParams(
        temperature=0, max_new_tokens=n)), Future()) for i, (p, n) in enumerate(asks)]
    runner.prefill(rows[:2])
    runner.retire_finished()  # row 0 finished at its first token: retired, still in its slot
    runner.prefill(rows[2:])  # admitted: one live row and one chunking, within max_batch_size
    while runner.chunking:
        runner.prefill_chunk()
    assert runner.rows == rows[1:] and runner.num_running == 2


def test_a_request_that_breaks_a_fast_decode_step_fails_alone(model_dir):
    from miles.engine_api.errors import RequestFailed

    long_prompt = [11 + i % 50 for i in range(40)]
    limit = len(long_prompt) + 4
    engine = _engine(model_dir, True)
    try:
        greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
        honest = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]  # short: their positions never reach the limit
        alone = _run(engine, [(p, greedy, {}) for p in honest])
        forward = engine.runner.fast.forward

        def faulty(kv, tokens, pos, Lb):  # the long row's decode crosses the limit; nobody else's does
            if int(pos.max()) >= limit:
                raise RuntimeError("injected fault in the decode forward")
            return forward(kv, tokens, pos, Lb)

        engine.runner.fast.forward = faulty
        futures = [engine.submit(engine.make_request(p, greedy, return_logprob=True)) for p in honest]
        bad = engine.submit(engine.make_request(long_prompt, greedy))
        with pytest.raises(RequestFailed):
            bad.result(120)
        assert [f.result(120).output_ids for f in futures] == [o.output_ids for o in alone]
    finally:
        engine.stop()


def test_a_pause_records_the_step_the_host_was_behind_on(model_dir):
    engine = _engine(model_dir, True)
    try:
        streamed: list[int] = []
        params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
        done = engine.submit(engine.make_request(PROMPTS[0], params), listener=lambda ids, lps: streamed.extend(ids))
        while len(streamed) < 5:
            time.sleep(0.001)
        engine.pause("in_place")
        (row,) = engine.runner.rows
        assert engine.runner.decoder.pending is None and streamed == row.output_ids  # every launched step recorded
        engine.continue_generation()
        out = done.result(60)
        assert len(out.output_ids) == 200 and out.output_ids == streamed
    finally:
        engine.stop()


@pytest.mark.cuda
def test_on_cuda_graphs_and_chunked_prefill_give_the_cpu_eager_paths_outputs(model_dir):
    long_prompt = PROMPTS[2] + PROMPTS[4]  # 81 tokens: chunked at 16
    reqs = [(p, SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True), {})
            for p in [PROMPTS[0], PROMPTS[1], long_prompt, PROMPTS[3], PROMPTS[4]]]
    reqs += [(p, SamplingParams(temperature=1.0, top_k=5, max_new_tokens=20, seed=i), {})
             for i, p in enumerate(PROMPTS)]
    outs = []
    for device, fast in (("cpu", False), ("cuda", True)):
        engine = _engine(model_dir, fast, device=device, prefill_chunk_tokens=16)
        try:
            assert engine.runner.fast is None or engine.runner.fast.use_graphs
            outs.append(_run(engine, reqs, stagger=0.01))
        finally:
            engine.stop()
    _assert_same(*outs)
