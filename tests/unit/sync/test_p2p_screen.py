"""The p2p sender screens every byte for NaN/Inf while it writes the engines' copies, so an engine
adopts a buffer it lent without reading it again; a NaN is refused by name before any engine applies
it, and the engine still screens anything that is not in a buffer of its own."""

from __future__ import annotations

import httpx
import pytest
import torch

from miles.sync import screen, shm, verify
from miles.sync.prepare import push_weights
from miles.sync.transports import TransportError, get_transport


def _bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    nan = torch.randn(3000, generator=g).to(torch.bfloat16)
    nan[2900] = float("nan")  # in the last chunk, not the first
    inf = torch.randn(40, 50, generator=g)
    inf[39, 49] = float("-inf")
    huge = torch.full((1000,), 3e38)  # finite, though its sum overflows
    return [("a", torch.randn(777, generator=g).to(torch.bfloat16)), ("nan", nan), ("ids", torch.arange(500)),
            ("inf", inf), ("huge", huge), ("empty", torch.empty(0))]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_screened_fills_every_buffer_and_names_exactly_the_non_finite_tensors(monkeypatch, threads):
    monkeypatch.setattr(screen, "CHUNK_BYTES", 256)  # many chunks per tensor, split across the threads
    bucket = _bucket()
    offsets, nbytes = shm.layout(bucket)
    bufs = [torch.zeros(nbytes + 64, dtype=torch.uint8) for _ in range(3)]

    bad = screen.copy_screened(bufs, bucket, offsets, threads=threads)

    assert bad == ["nan", "inf"]
    for buf in bufs:
        for (name, t), off in zip(bucket, offsets):
            n = t.numel() * t.element_size()
            got = buf[off:off + n].view(t.dtype).reshape(t.shape)
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name


def test_p2p_refuses_a_non_finite_tensor_by_name_and_engines_keep_their_weights(engine_thread, admin_token):
    url = engine_thread.url
    sd = {n: t.clone() for n, t in engine_thread.engine.model.state_dict().items()}
    name = "model.layers.0.mlp.up_proj.weight"
    transport = get_transport("p2p", mode="shm", admin_token=admin_token, buffer_bytes=1 << 16)
    transport.connect([url])
    try:
        push_weights(iter([(n, t + 0.01) for n, t in sd.items() if n != "lm_head.weight"]), transport, 5,
                     bucket_bytes=1 << 18)
        held = engine_thread.engine.model.state_dict()[name].clone()
        bad = held.clone()
        bad.view(-1)[11] = float("nan")
        with pytest.raises(TransportError, match="NaN or Inf") as err:
            transport.send_bucket([(name, bad)])
        assert repr(name) in str(err.value)
        with pytest.raises(TransportError, match="not committing"):
            transport.commit(6)
        assert engine_thread.engine.weight_version == "5"
        assert torch.equal(engine_thread.engine.model.state_dict()[name], held)
        transport.send_bucket([(name, held * 2)])  # the next version starts clean
        transport.commit(6)
    finally:
        transport.close()
    assert engine_thread.engine.weight_version == "6"
    assert torch.equal(engine_thread.engine.model.state_dict()[name], held * 2)


def test_an_engine_does_not_read_a_screened_version_again(engine_thread, admin_token, monkeypatch):
    """The engine runs in this process, so its screen can be counted."""
    calls = []
    real = verify.finite
    monkeypatch.setattr(verify, "finite", lambda t: calls.append(t.numel()) or real(t))
    state = {n: t + 0.5 for n, t in engine_thread.engine.model.state_dict().items() if n != "lm_head.weight"}
    transport = get_transport("p2p", mode="shm", admin_token=admin_token, buffer_bytes=1 << 16)
    transport.connect([engine_thread.url])
    try:
        push_weights(iter(state.items()), transport, 9, bucket_bytes=1 << 18)
    finally:
        transport.close()
    assert engine_thread.engine.weight_version == "9"
    assert calls == []
    assert torch.equal(engine_thread.engine.model.state_dict()["model.norm.weight"], state["model.norm.weight"])


def test_screened_is_not_trusted_for_a_buffer_the_engine_did_not_lend(engine_thread, admin_token):
    name = "model.norm.weight"
    before = engine_thread.engine.model.state_dict()[name].clone()
    bad = before.clone()
    bad[0] = float("inf")
    path, buf = shm.create(bad.numel() * bad.element_size(), tag="test")
    try:
        shm.write_bucket(buf, [(name, bad)], [0])
        r = httpx.post(f"{engine_thread.url}/update_weights_from_tensor", timeout=60,
                       headers={"Authorization": f"Bearer {admin_token}"},
                       json={"load_format": "shm", "shm_path": path, "names": [name], "dtypes": ["float32"],
                             "shapes": [list(bad.shape)], "offsets": [0], "commit": True, "weight_version": "77",
                             "screened": True})
    finally:
        shm.unlink(path)
    assert r.status_code == 400 and "NaN or Inf" in r.json()["error"], r.text
    assert torch.equal(engine_thread.engine.model.state_dict()[name], before)
