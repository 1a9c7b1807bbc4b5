"""Weights an engine serves in a low-precision format travel as that format's bytes and scales: the
wire carries the quantized size, and the engine serves exactly what a full-precision push followed by
its own quantization would have given it, over broadcast, p2p and disk-delta.

Two engines per format, each on a thread of this process: `wire` receives quantized pushes, `ref`
full-precision ones (sync.quantized_wire = false) and quantizes them itself.
"""

from __future__ import annotations

import itertools

import httpx
import pytest
import torch

from miles.precision import linear, wire
from miles.precision.formats import get_format, quantize
from miles.precision.linear import InFormat
from miles.engine.config import EngineConfig
from miles.engine.server import start_server_thread
from miles.sync.prepare import SyncConfig
from miles.sync.transports.disk_delta import DiskDeltaConfig
from miles.sync.updater import WeightUpdater

PROMPT = [5, 17, 33, 8, 40, 2]
_versions = itertools.count(1)  # the engines live across tests, and versions only move forward


@pytest.fixture(scope="module")
def engines(base_model_dir, admin_token):
    """engines(fmt) -> (wire engine, ref engine), float32, serving `fmt` (and with `embeddings`, the tied
    embedding and LM head in it too); started once per setting."""
    started: dict[tuple, tuple] = {}

    def get(fmt: str, embeddings: bool = False):
        if (fmt, embeddings) not in started:
            started[fmt, embeddings] = tuple(start_server_thread(EngineConfig(
                model_path=base_model_dir, dtype="float32", quantization=fmt, quantize_embeddings=embeddings,
                admin_token=admin_token)) for _ in range(2))
        return started[fmt, embeddings]

    yield get
    for pair in started.values():
        for server in pair:
            server.stop()


def _state(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    from miles.models.loading import load_model

    g = torch.Generator().manual_seed(seed)
    out, seen = {}, set()
    for name, t in load_model(model_dir).state_dict().items():
        if t.untyped_storage().data_ptr() in seen:  # the tied lm_head travels as the embedding
            continue
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t + torch.randn(t.shape, generator=g) * 0.05
    return out


def _served(server) -> dict[str, torch.Tensor]:
    """What each quantized layer of the engine multiplies with."""
    with torch.no_grad():
        return {n: m.effective_weight() for n, m in server.engine.model.named_modules() if isinstance(m, InFormat)}


def _logprobs(server) -> list[float]:
    r = httpx.post(f"{server.url}/generate", timeout=120, json={"input_ids": PROMPT, "return_logprob": True,
                   "sampling_params": {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 3,
                                       "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return [lp for lp, _, _ in r.json()["meta_info"]["output_token_logprobs"]]


def _assert_same_policy(a, b) -> None:
    sa, sb = _served(a), _served(b)
    assert sa and sa.keys() == sb.keys()
    differ = [n for n in sa if not torch.equal(sa[n], sb[n])]
    assert not differ, f"served weights differ: {differ[:4]}"
    assert _logprobs(a) == _logprobs(b)  # bit for bit


def _quantized_bytes(state: dict[str, torch.Tensor], served: dict, fmt: str) -> int:
    """Values + scales of every weight the engine serves in `fmt`, full bytes of the rest."""
    return sum(quantize(t, fmt).nbytes if n in served else t.numel() * t.element_size() for n, t in state.items())


@pytest.mark.parametrize("transport,fmt", [("broadcast", "fp8"), ("p2p", "fp8"), ("broadcast", "nvfp4"),
                                           ("p2p", "mxfp8")])
def test_a_quantized_push_moves_the_quantized_size_and_serves_what_the_engine_would_quantize(
        transport, fmt, engines, base_model_dir, admin_token, monkeypatch):
    wired, ref = engines(fmt)
    q = WeightUpdater(SyncConfig(transport=transport, bucket_size_mb=1), admin_token, base_model_dir)
    full = WeightUpdater(SyncConfig(transport=transport, bucket_size_mb=1, quantized_wire=False), admin_token,
                         base_model_dir)
    q.connect([wired.url])
    full.connect([ref.url])
    try:
        served = wired.engine.quantized
        assert q.quantized.keys() == served.keys() and not full.quantized
        for seed in (1, 2):  # the first push is noise-filled and checked tensor by tensor, the second by bucket
            state = _state(base_model_dir, seed)
            version = next(_versions)
            mq = q.push(iter(state.items()), version)
            mf = full.push(iter(state.items()), version)
            assert mq["sync/bytes"] == _quantized_bytes(state, served, fmt)
            assert mf["sync/bytes"] == sum(t.numel() * 4 for t in state.values())
            assert mq["sync/bytes"] < 0.6 * mf["sync/bytes"]
            assert mq.get("sync/verified_tensors", mq.get("sync/verified_buckets"))
            # The engine installed the bytes it received: serving them quantizes nothing.
            calls = []
            monkeypatch.setattr(linear, "quantize", lambda *a, **k: calls.append(a) or quantize(*a, **k))
            _served(wired)
            assert calls == []
            _served(ref)  # (the engine that received full precision does quantize)
            assert calls
            monkeypatch.undo()
            _assert_same_policy(wired, ref)
    finally:
        q.close()
        full.close()


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_with_the_embeddings_in_the_format_a_4bit_push_moves_at_most_0_3_of_the_bfloat16_bytes(
        fmt, engines, base_model_dir, admin_token):
    # Without them it cannot: the tied embedding and the norms in bfloat16 alone are 5% of this model's
    # bfloat16 bytes, and a 4-bit weight with its scales is over a quarter of its bfloat16 size.
    wired, ref = engines(fmt, embeddings=True)
    q = WeightUpdater(SyncConfig(transport="broadcast", bucket_size_mb=1, dtype="bfloat16"), admin_token,
                      base_model_dir)
    full = WeightUpdater(SyncConfig(transport="broadcast", bucket_size_mb=1, dtype="bfloat16", quantized_wire=False),
                         admin_token, base_model_dir)
    q.connect([wired.url])
    full.connect([ref.url])
    try:
        served = wired.engine.quantized
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= served.keys()
        state = {n: t.to(torch.bfloat16) for n, t in _state(base_model_dir, 7).items()}
        version = next(_versions)
        mq = q.push(iter(state.items()), version)
        mf = full.push(iter(state.items()), version)
        assert mf["sync/bytes"] == sum(t.numel() * 2 for t in state.values())
        assert mq["sync/bytes"] == _quantized_bytes(state, served, fmt)
        assert mq["sync/bytes"] <= 0.3 * mf["sync/bytes"]
        _assert_same_policy(wired, ref)  # the embedding and head included: both engines serve one policy
    finally:
        q.close()
        full.close()


def test_disk_delta_ships_only_changed_quantized_bytes(engines, base_model_dir, admin_token, tmp_path):
    wired, ref = engines("fp8")
    fmt = get_format("fp8")
    cfg = DiskDeltaConfig(transport="disk_delta", delta_dir=str(tmp_path / "deltas"), bucket_size_mb=1)
    delta = WeightUpdater(cfg, admin_token, base_model_dir)
    full = WeightUpdater(SyncConfig(transport="broadcast", bucket_size_mb=1), admin_token, base_model_dir)
    delta.connect([wired.url])
    full.connect([ref.url])
    try:
        served = wired.engine.quantized
        first = _state(base_model_dir, 5)
        delta.push(iter(first.items()), next(_versions))
        # The next version changes one row of one quantized weight: a few of its blocks' bytes change.
        changed = "model.layers.0.mlp.up_proj.weight"
        second = dict(first)
        second[changed] = first[changed].clone()
        second[changed][3] += 0.01
        version = next(_versions)
        m = delta.push(iter(second.items()), version)
        assert m["sync/delta/full_bytes"] == _quantized_bytes(second, served, "fp8")
        before, after = (wire.encode(s[changed], fmt, False)[0] for s in (first, second))
        assert m["sync/delta/changed_bytes"] == int((before != after).sum()) > 0
        assert m["sync/delta/wire_bytes"] < m["sync/delta/full_bytes"] / 20
        full.push(iter(second.items()), version)  # a full quantized push of the same version
        _assert_same_policy(wired, ref)
        with torch.no_grad():  # and every parameter, quantized ones as their dequantized values, alike
            pw, pr = wired.engine.model.state_dict(), ref.engine.model.state_dict()
            assert all(torch.equal(pw[n], pr[n]) for n in pw)
    finally:
        delta.close()
        full.close()


def test_a_quantized_tensor_the_engine_cannot_install_is_refused_by_name(engines):
    wired, _ = engines("fp8")
    receiver = wired.engine.receiver
    name = "model.layers.0.mlp.up_proj.weight"
    shape, _ = wired.engine.param_meta[name]
    payload = wire.encode(torch.randn(shape), get_format("fp8"), False)[0]
    with receiver.lock:
        assert receiver.validate({f"{name}@fp8": payload}) is None
        err = receiver.validate({f"{name}@fp8": payload[:-1]})
        assert f"{name}@fp8" in err and str(payload.numel()) in err
        err = receiver.validate({f"{name}@nvfp4": payload})
        assert "serves it in 'fp8'" in err and "full precision" in err
        err = receiver.validate({"model.embed_tokens.weight@fp8": payload})
        assert "does not serve 'model.embed_tokens.weight' in a format" in err
        receiver.clear()
