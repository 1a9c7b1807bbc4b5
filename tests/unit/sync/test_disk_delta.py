"""Disk-delta updates: only changed bytes travel, and a damaged delta never reaches an engine.

Each corruption (flipped byte, truncated shard, missing shard, wrong base version) must refuse the
whole update with an error naming the tensor and the cause, reload no engine, and leave generation
running on the previous version; the next good version then goes through.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from miles.sync.prepare import buckets
from miles.sync.transports import TransportError
from miles.sync.transports.delta_format import version_dir
from miles.sync.transports.disk_delta import DiskDeltaTransport

PROMPT = [19, 20, 15, 21, 31, 27]


def _state(model_dir: str, seed: int | None, touched: float = 1.0) -> dict[str, torch.Tensor]:
    """The base checkpoint's tensors, with a fraction of the tensors perturbed."""
    from miles.sync.transports.delta_format import load_base

    base = load_base(model_dir)
    if seed is None:
        return base
    g = torch.Generator().manual_seed(seed)
    names = sorted(base)
    for name in names[: max(1, int(len(names) * touched))]:
        base[name] = base[name] + torch.randn(base[name].shape, generator=g) * 0.05
    return base


def _generate(url: str) -> dict:
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": PROMPT, "return_logprob": True, "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert r.status_code == 200, r.text
    return r.json()


def _send(transport, state, bucket_bytes=128 * 1024):
    for b in buckets(iter(state.items()), bucket_bytes):
        transport.send_bucket(b)


@pytest.fixture
def delta(engine_proc, engine_thread, base_model_dir, admin_token, tmp_path):
    # Each test restarts the numbering at the base on engines an earlier test advanced: versions only
    # move forward, so the engines are relabelled first (SGLang's explicit /update_weight_version).
    for url in (engine_proc.url, engine_thread.url):
        httpx.post(f"{url}/update_weight_version", json={"new_version": "default"}, timeout=60,
                   headers={"Authorization": f"Bearer {admin_token}"}).raise_for_status()
    t = DiskDeltaTransport(delta_dir=str(tmp_path / "deltas"), base_path=base_model_dir, admin_token=admin_token,
                           local_dir=str(tmp_path / "local"))
    t.connect([engine_proc.url, engine_thread.url])
    yield t
    t.close()


def test_only_changed_bytes_travel_and_engines_match(delta, engine_thread, base_model_dir):
    state = _state(base_model_dir, seed=5, touched=0.25)
    _send(delta, state)
    delta.commit(1)
    stats = delta.last_stats
    assert stats["delta/wire_bytes"] < 0.5 * stats["delta/full_bytes"], stats
    assert 0 < stats["delta/changed_bytes"] < stats["delta/full_bytes"]
    engine_state = engine_thread.engine.model.state_dict()
    assert all(torch.equal(engine_state[n], t) for n, t in state.items())
    index = json.load(open(os.path.join(version_dir(delta.delta_dir, 1), "index.json")))
    assert index["version"] == 1 and index["base_version"] == 0 and index["encoding"] == "xor-zstd"
    assert all(len(e["xxh3_128"]) == 32 for e in index["tensors"].values())


def _flip(vdir):
    path = os.path.join(vdir, "shard-00001.zst")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    return "shard-00001.zst"


def _truncate(vdir):
    path = os.path.join(vdir, "shard-00001.zst")
    os.truncate(path, os.path.getsize(path) // 2)
    return "truncated"


def _remove(vdir):
    os.remove(os.path.join(vdir, "shard-00001.zst"))
    return "missing"


def _wrong_base(vdir):
    path = os.path.join(vdir, "index.json")
    index = json.load(open(path))
    index["base_version"] = 99
    json.dump(index, open(path, "w"))
    return "built on version 99"


@pytest.mark.parametrize("corrupt", [_flip, _truncate, _remove, _wrong_base], ids=lambda f: f.__name__[1:])
def test_damaged_delta_is_refused_and_no_engine_reloads(corrupt, delta, engine_proc, engine_thread, base_model_dir):
    urls = [engine_proc.url, engine_thread.url]
    good = _state(base_model_dir, seed=6)
    _send(delta, good)
    delta.commit(1)
    before = [_generate(u) for u in urls]
    assert [b["meta_info"]["weight_version"] for b in before] == ["1", "1"]

    _send(delta, _state(base_model_dir, seed=7))
    vdir = delta.write(2)
    cause = corrupt(vdir)
    with pytest.raises(TransportError) as err:
        delta.apply(2)
    msg = str(err.value)
    assert cause in msg and "no engine reloaded" in msg
    if corrupt is not _wrong_base:
        assert "tensor 'model." in msg  # names the tensor
    for url, b in zip(urls, before):
        after = _generate(url)
        assert after["meta_info"]["weight_version"] == "1"
        assert after["output_ids"] == b["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    engine_state = engine_thread.engine.model.state_dict()
    assert all(torch.equal(engine_state[n], t) for n, t in good.items())

    # The next version is a delta against what the engines really hold (version 1), and applies.
    newer = _state(base_model_dir, seed=8)
    _send(delta, newer)
    delta.commit(3)
    assert all(torch.equal(engine_state[n], t) for n, t in newer.items())
    assert _generate(urls[0])["meta_info"]["weight_version"] == "3"


def test_failed_write_refuses_the_commit(delta, engine_thread, base_model_dir, monkeypatch):
    import miles.sync.transports.disk_delta as dd

    version = engine_thread.engine.weight_version

    def disk_full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dd, "write_atomic", disk_full)
    with pytest.raises(TransportError, match="No space left"):
        _send(delta, _state(base_model_dir, seed=9))
    monkeypatch.undo()
    with pytest.raises(TransportError, match="not committing weight version 4"):
        delta.commit(4)
    assert engine_thread.engine.weight_version == version
