"""The built-in engine's device: the same code path on cpu and cuda, its memory budget, and what it refuses.

The CPU tests run everywhere (CI). The tests marked `cuda` run where torch sees a GPU
(scripts/gpu-check.sh runs them): on the GPU the engine must give the outputs of transformers on the
same GPU, and the outputs of its own CPU path, for every feature it serves.
"""

from __future__ import annotations

import pytest
import torch

from miles.config.loader import ConfigError
from miles.engine_api.sampling import SamplingParams
from miles.engine.config import EngineConfig
from miles.engine.engine import Engine
from tests.unit.engine.test_engine_lora import _write_adapter

PROMPTS = ["47+38=", "1+2=", "The trainer computes a policy", "ls cat echo grep python file"]


def _engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(model_path=str(model_dir), **kw))


def _greedy_all(engine: Engine, prompts: list[list[int]], n: int, **req):
    """Submit every prompt at once (one running batch), then collect the results in order."""
    futures = [engine.submit(engine.make_request(ids, SamplingParams(temperature=0, max_new_tokens=n), **req))
               for ids in prompts]
    return [f.result(120) for f in futures]


def test_auto_serves_on_cpu_without_a_gpu(model_dir):
    engine = _engine(model_dir)
    try:
        want = "cuda" if torch.cuda.is_available() else "cpu"
        assert engine.runner.device.type == want
        assert next(engine.model.parameters()).device.type == want
        assert engine.runner.kv_budget > engine.context_length
    finally:
        engine.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_naming_the_key(model_dir):
    with pytest.raises(ConfigError, match="rollout.engine.device = 'cuda' but torch sees no CUDA device here"):
        _engine(model_dir, device="cuda")


def test_a_model_larger_than_the_memory_fraction_is_refused_with_the_fix(model_dir):
    with pytest.raises(ConfigError, match=r"the model's weights take .* GiB, more than memory_fraction = 1e-09 .*"
                                          r"raise rollout.engine.memory_fraction"):
        _engine(model_dir, device="cpu", memory_fraction=1e-9)


def test_a_kv_budget_below_one_context_is_refused_with_the_fix(model_dir):
    from miles.devices import total_memory
    from miles.models.loading import load_model
    from miles.engine.kv_cache import bytes_per_token

    model = load_model(str(model_dir))
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # Room for the weights and the prefix cache and half a context of KV.
    fraction = (weights + 2**20 + 0.5 * 64 * bytes_per_token(model)) / total_memory("cpu")
    with pytest.raises(ConfigError, match=r"leaves KV for \d+ tokens, fewer than one sequence of context_length = 64"):
        _engine(model_dir, device="cpu", memory_fraction=fraction, prefix_cache_mb=1, context_length=64)


def test_requests_beyond_the_kv_budget_wait_and_still_finish(model_dir, tokenizer, ref):
    """A budget of two full sequences runs at most two rows at once; the rest queue and complete."""
    from miles.devices import total_memory
    from miles.models.loading import load_model
    from miles.engine.kv_cache import bytes_per_token

    model = load_model(str(model_dir))
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    fraction = (weights + 2.5 * 64 * bytes_per_token(model)) / total_memory("cpu")
    engine = _engine(model_dir, device="cpu", memory_fraction=fraction, prefix_cache=False, context_length=64)
    try:
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        outs = _greedy_all(engine, prompts, 60)  # each row may reach the whole context: 64 tokens reserved
        assert [o.output_ids for o in outs] == [ref.greedy(ids, min(60, 64 - len(ids))) for ids in prompts]
        assert engine.stats["max_running_reqs"] == 2
    finally:
        engine.stop()


def test_an_unknown_engine_device_is_refused_with_the_choices(model_dir):
    with pytest.raises(ConfigError, match="engine device = 'tpu': choose auto"):
        EngineConfig(model_path=str(model_dir), device="tpu").validate()


# ---- on a GPU -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_engine(model_dir):
    engine = _engine(model_dir, device="cuda")
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def cpu_engine(model_dir):
    engine = _engine(model_dir, device="cpu")
    yield engine
    engine.stop()


def _hf_greedy(model, ids: list[int], n: int, eos: set[int]) -> list[int]:
    out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones((1, len(ids)), dtype=torch.long, device=model.device),
                         pad_token_id=0)[0, len(ids):].tolist()
    for i, t in enumerate(out):
        if t in eos:
            return out[:i + 1]
    return out


@pytest.mark.cuda
def test_cuda_greedy_ids_equal_transformers_generate_on_the_gpu_in_float32(cuda_engine, model_dir, tokenizer):
    from miles.models.loading import load_model

    hf = load_model(str(model_dir), device="cuda").eval()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outs = _greedy_all(cuda_engine, prompts, 32)
    eos = set(cuda_engine.runner.eos_token_ids)
    assert next(cuda_engine.model.parameters()).device.type == "cuda"
    for ids, out in zip(prompts, outs):
        assert out.output_ids == _hf_greedy(hf, ids, 32, eos)


@pytest.mark.cuda
def test_cuda_streams_the_tokens_the_cpu_path_generates(cuda_engine, cpu_engine, tokenizer):
    ids = tokenizer.encode(PROMPTS[0])
    streamed: list[int] = []
    req = cuda_engine.make_request(ids, SamplingParams(temperature=0, max_new_tokens=16))
    done = cuda_engine.submit(req, listener=lambda new, _lps: streamed.extend(new)).result(60)
    assert streamed == done.output_ids == _greedy_all(cpu_engine, [ids], 16)[0].output_ids


@pytest.mark.cuda
def test_cuda_outputs_equal_the_cpu_paths_for_every_feature(cuda_engine, cpu_engine, tokenizer, tmp_path):
    """Greedy ids, output and input logprobs, a LoRA adapter and streamed tokens: the same on both devices."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    kw = {"return_logprob": True, "logprob_start_len": 0}
    on_gpu, on_cpu = _greedy_all(cuda_engine, prompts, 24, **kw), _greedy_all(cpu_engine, prompts, 24, **kw)
    for g, c in zip(on_gpu, on_cpu):
        assert g.output_ids == c.output_ids
        assert max(abs(a - b) for a, b in zip(g.output_logprobs, c.output_logprobs)) < 1e-4
        assert max(abs(a - b) for a, b in zip(g.input_logprobs[1][1:], c.input_logprobs[1][1:])) < 1e-4
    _write_adapter(cpu_engine.config.model_path, tmp_path / "a", seed=1)
    for e in (cuda_engine, cpu_engine):
        e.load_lora_adapter("a", str(tmp_path / "a"))
    g, c = (_greedy_all(e, prompts[:2], 16, lora_path="a", return_logprob=True) for e in (cuda_engine, cpu_engine))
    assert [o.output_ids for o in g] == [o.output_ids for o in c]
    assert max(abs(a - b) for o, p in zip(g, c) for a, b in zip(o.output_logprobs, p.output_logprobs)) < 1e-4
    for e in (cuda_engine, cpu_engine):
        e.unload_lora_adapter("a")


@pytest.mark.cuda
def test_cuda_bfloat16_logprobs_are_within_bf16_tolerance_of_a_float32_forward(model_dir, tokenizer):
    from miles.models.loading import load_model

    engine = _engine(model_dir, device="cuda", dtype="bfloat16")
    try:
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        futures = [engine.submit(engine.make_request(ids, SamplingParams(temperature=1.0, max_new_tokens=24, seed=i),
                                                     return_logprob=True)) for i, ids in enumerate(prompts)]
        outs = [f.result(120) for f in futures]
    finally:
        engine.stop()
    hf = load_model(str(model_dir), device="cuda").eval()
    diffs = []
    for ids, out in zip(prompts, outs):
        seq = torch.tensor([ids + out.output_ids], device="cuda")
        with torch.no_grad():
            logits = hf(seq).logits[0, len(ids) - 1:-1].float()
        want = torch.log_softmax(logits, -1).gather(1, seq[0, len(ids):, None])[:, 0]
        diffs.append((want - torch.tensor(out.output_logprobs, device="cuda")).abs())
    d = torch.cat(diffs)
    assert d.mean() < 0.02 and d.max() < 0.15, (d.mean().item(), d.max().item())


@pytest.mark.cuda
def test_cuda_routed_experts_and_quantized_serving_equal_the_cpu_path(tiny_moe_model_dir):
    ids = list(range(5, 21))
    for kw in ({}, {"quantization": "fp8"}):
        outs = []
        for device in ("cuda", "cpu"):
            engine = _engine(tiny_moe_model_dir, device=device, **kw)
            try:
                req = engine.make_request(ids, SamplingParams(temperature=0, max_new_tokens=12), return_logprob=True,
                                          return_routed_experts=True)
                outs.append(engine.submit(req).result(120))
            finally:
                engine.stop()
        g, c = outs
        assert g.output_ids == c.output_ids, kw
        assert g.routed_experts == c.routed_experts, kw
        assert max(abs(a - b) for a, b in zip(g.output_logprobs, c.output_logprobs)) < 1e-3, kw


@pytest.mark.cuda
def test_cuda_release_frees_device_memory_and_resume_serves_the_same_tokens(model_dir, tokenizer):
    engine = _engine(model_dir, device="cuda")
    try:
        ids = tokenizer.encode(PROMPTS[2])
        before = _greedy_all(engine, [ids], 16)[0].output_ids
        held = torch.cuda.memory_allocated()
        engine.release_memory(("weights", "kv_cache"))
        assert torch.cuda.memory_allocated() < held - 0.9 * sum(
            p._host.numel() * p._host.element_size() for p in engine.model.parameters())
        engine.resume_memory(("weights", "kv_cache"))
        assert _greedy_all(engine, [ids], 16)[0].output_ids == before
    finally:
        engine.stop()
