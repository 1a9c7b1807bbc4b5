"""Every transport delivers the trainer's exact bytes into running engines, and a transport that
drops a tensor is caught by the noise-fill check at the first update.

Two engines: one in its own process (as deployed) and one on a thread of this test process, whose
parameters the test reads directly to compare bit for bit with what the trainer sent.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from miles.sync.prepare import SyncConfig, push_weights
from miles.sync.transports import TRANSPORTS, get_transport
from miles.sync.verify import VerificationError, tensor_checksum
from miles.versions import from_wire


def _perturbed_state(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    from miles.models.loading import load_model

    model = load_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.untyped_storage().data_ptr() in seen:  # tied lm_head travels as the embedding
            continue
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t + torch.randn(t.shape, generator=g) * 0.05
    return out


def _version(url: str) -> int:
    """The engine's weight version: a string on the wire (SGLang's type), read back as the step."""
    v = httpx.get(f"{url}/get_model_info").json()["weight_version"]
    assert isinstance(v, str), v
    return from_wire(v)


def _assert_engine_holds(server, state: dict[str, torch.Tensor]) -> None:
    engine_state = server.engine.model.state_dict()
    differ = [n for n, t in state.items() if not torch.equal(engine_state[n], t)]
    assert not differ, f"engine tensors differ from the trainer's: {differ[:5]}"


def _kwargs(name: str, admin_token: str, base_model_dir: str, tmp_path) -> dict:
    if name == "p2p-shm":
        return {"mode": "shm", "admin_token": admin_token, "buffer_bytes": 1 << 16}  # regrows for big buckets
    if name == "p2p-tcp":
        return {"mode": "tcp", "admin_token": admin_token}
    if name == "colocated":
        return {"admin_token": admin_token, "buffer_bytes": 1 << 16}
    if name == "disk":
        return {"admin_token": admin_token, "disk_dir": str(tmp_path / "weights"), "base_path": base_model_dir}
    return {"admin_token": admin_token, "delta_dir": str(tmp_path / "deltas"), "base_path": base_model_dir}


@pytest.mark.parametrize("name", ["p2p-shm", "p2p-tcp", "colocated", "disk_delta", "disk"])
def test_transport_delivers_exact_bytes(name, engine_proc, engine_thread, base_model_dir, admin_token, tmp_path):
    transport = get_transport(name.split("-")[0], **_kwargs(name, admin_token, base_model_dir, tmp_path))
    urls = [engine_proc.url, engine_thread.url]
    transport.connect(urls)
    try:
        for version, seed in ((11, 1), (12, 2)):  # a second version: deltas chain, buffers are reused
            state = _perturbed_state(base_model_dir, seed)
            stats = push_weights(iter(state.items()), transport, version, bucket_bytes=256 * 1024)
            assert stats["sync/buckets"] >= 3
            assert [_version(u) for u in urls] == [version, version]
            _assert_engine_holds(engine_thread, state)
            expected = {n: ["float32", tensor_checksum(t)] for n, t in state.items()}
            r = httpx.post(f"{engine_proc.url}/weights_checker", json={"action": "compare", "expected": expected},
                           headers={"Authorization": f"Bearer {admin_token}"}).json()
            assert r["success"], r
    finally:
        transport.close()


class SkippingTransport:
    """A faulty wire: forwards every bucket but silently drops one tensor."""

    def __init__(self, inner, skip: str):
        self.inner, self.skip = inner, skip

    def connect(self, urls):
        self.inner.connect(urls)

    def send_bucket(self, bucket):
        self.inner.send_bucket([(n, t) for n, t in bucket if n != self.skip])

    def commit(self, version):
        self.inner.commit(version)

    def close(self):
        self.inner.close()


def test_noise_fill_catches_a_tensor_the_transport_never_wrote(engine_thread, base_model_dir, admin_token):
    from miles.sync.updater import WeightUpdater

    skipped = "model.layers.1.mlp.down_proj.weight"
    # retries=0: a retry would build a fresh (non-skipping) sender and pass, which is the point of retries
    updater = WeightUpdater(SyncConfig(transport="colocated", bucket_size_mb=1, retries=0), admin_token,
                            base_model_dir)
    updater.transport = SkippingTransport(updater.transport, skipped)
    updater.connect([engine_thread.url])
    try:
        # The engine starts with the very weights the trainer sends, so only the noise fill can tell.
        state = _perturbed_state(base_model_dir, seed=0)
        state = {n: t for n, t in engine_thread.engine.model.state_dict().items() if n in state}
        with pytest.raises(VerificationError) as err:
            updater.push(iter({n: t.clone() for n, t in state.items()}.items()), version=21)
        assert skipped in str(err.value) and engine_thread.url in str(err.value)
        assert "never written" in str(err.value)
    finally:
        updater.close()


def test_verified_updates_pass_and_later_ones_use_bucket_checksums(engine_thread, base_model_dir, admin_token):
    from miles.sync.updater import WeightUpdater

    updater = WeightUpdater(SyncConfig(transport="colocated", bucket_size_mb=1, dtype="bfloat16"), admin_token,
                            base_model_dir)
    updater.connect([engine_thread.url])
    try:
        state = _perturbed_state(base_model_dir, seed=3)
        first = updater.push(iter(state.items()), version=31)
        assert first["sync/verified_tensors"] == len(state)
        # Engines were held during the noise-filled window and are generating again.
        assert httpx.get(f"{engine_thread.url}/get_load").json()["paused"] is False
        assert httpx.post(f"{engine_thread.url}/generate", json={"input_ids": [5, 6], "sampling_params": {
            "max_new_tokens": 2}}, timeout=60).json()["meta_info"]["weight_version"] == "31"
        second = updater.push(iter(_perturbed_state(base_model_dir, seed=4).items()), version=32)
        assert second["sync/verified_buckets"] == second["sync/buckets"] >= 1
        # The engine is fp32, the wire bf16: the engine holds exactly the upcast bf16 values.
        expected = {n: t.to(torch.bfloat16).float() for n, t in _perturbed_state(base_model_dir, seed=4).items()}
        _assert_engine_holds(engine_thread, expected)
    finally:
        updater.close()




def test_registry_lists_every_transport():
    assert set(TRANSPORTS) == {"broadcast", "p2p", "disk_delta", "disk", "colocated"}


def test_broadcast_sends_large_tensors_unflattened_and_exact(engine_thread, base_model_dir, admin_token, monkeypatch):
    import miles.sync.transports.broadcast_wire as bc

    # Lower the split so the tiny model has both kinds: small tensors flattened, large ones alone.
    monkeypatch.setattr(bc, "SPLIT_BYTES", 4096)
    state = _perturbed_state(base_model_dir, seed=5)
    sizes = [t.numel() * t.element_size() for t in state.values()]
    assert min(sizes) < 4096 <= max(sizes)
    transport = get_transport("broadcast", admin_token=admin_token)
    transport.connect([engine_thread.url])
    try:
        push_weights(iter(state.items()), transport, 41, bucket_bytes=256 * 1024)
    finally:
        transport.close()
    assert _version(engine_thread.url) == 41
    _assert_engine_holds(engine_thread, state)
