"""The engine's end of update_weights_from_distributed, driven by a raw gloo group built as SGLang's
clients build theirs (torch's own group helper: the store's keys are torch's, not miles')."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import torch.distributed as dist

from miles.net import free_port
from miles.versions import from_wire
from tests.helpers.sglang_group import join_as_sglang

class RawTrainer:
    """Rank 0 of a fresh weight-update group, speaking the wire protocol by hand, its group built as
    a trainer written for SGLang builds it (tests/helpers/sglang_group.py)."""

    def __init__(self, url: str, token: str, group_name: str):
        self.url, self.group_name = url, group_name
        self.headers = {"Authorization": f"Bearer {token}"}
        self.pool = ThreadPoolExecutor(2)
        port = free_port()
        reply = self.pool.submit(self.post, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": "gloo"})
        self.pg = join_as_sglang("127.0.0.1", port, 0, 2, group_name)
        assert reply.result().status_code == 200, reply.result().text

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=60)

    def update(self, tensors: dict[str, torch.Tensor], wire_shapes=None, **extra) -> httpx.Response:
        """SGLang's default wire format: one broadcast per tensor, sent after the metadata."""
        body = {"names": list(tensors), "dtypes": [str(t.dtype) for t in tensors.values()],
                "shapes": wire_shapes or [list(t.shape) for t in tensors.values()], "group_name": self.group_name,
                **extra}
        reply = self.pool.submit(self.post, "/update_weights_from_distributed", body)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for t in tensors.values():
            self.pg.broadcast([t], opts).wait()
        return reply.result()


@pytest.fixture(scope="module")
def trainer(engine_thread, admin_token):
    return RawTrainer(engine_thread.url, admin_token, "raw_group")


def _param(engine_thread, name: str) -> torch.Tensor:
    return engine_thread.engine.model.state_dict()[name]


def test_single_shot_update_applies_and_sets_version(trainer, engine_thread):
    new = {"model.norm.weight": torch.full((128,), 0.5),
           "model.layers.1.input_layernorm.weight": torch.full((128,), 2.0)}
    r = trainer.update(new, weight_version="12")  # SGLang sends versions as strings
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == "12"
    assert httpx.get(engine_thread.url + "/get_model_info").json()["weight_version"] == "12"
    for name, t in new.items():
        assert torch.equal(_param(engine_thread, name), t)


def test_wrong_shape_after_receive_keeps_group_in_step(trainer, engine_thread):
    old = _param(engine_thread, "model.norm.weight").clone()
    version = engine_thread.engine.weight_version
    r = trainer.update({"model.norm.weight": torch.zeros(3)})
    assert r.status_code == 400
    assert "model.norm.weight" in r.json()["error"] and "[128]" in r.json()["error"]
    assert torch.equal(_param(engine_thread, "model.norm.weight"), old)
    assert engine_thread.engine.weight_version == version
    # The refused bucket was still received, so the next broadcast lines up.
    r = trainer.update({"model.norm.weight": torch.full((128,), 0.25)})
    assert r.status_code == 200, r.text
    assert torch.equal(_param(engine_thread, "model.norm.weight"), torch.full((128,), 0.25))
    assert engine_thread.engine.weight_version == version  # no version given: SGLang keeps the label


def test_non_finite_weights_are_refused(trainer, engine_thread):
    old = _param(engine_thread, "model.norm.weight").clone()
    bad = torch.ones(128)
    bad[3] = float("nan")
    r = trainer.update({"model.norm.weight": bad})
    assert r.status_code == 400 and "NaN" in r.json()["error"]
    assert torch.equal(_param(engine_thread, "model.norm.weight"), old)


def test_staged_buckets_wait_for_commit(trainer, engine_thread):
    before = _param(engine_thread, "model.norm.weight").clone()
    r = trainer.update({"model.norm.weight": torch.full((128,), 3.0)}, commit=False, reset_staging=True)
    assert r.status_code == 200, r.text
    assert torch.equal(_param(engine_thread, "model.norm.weight"), before)
    r = trainer.post("/update_weights_from_distributed", {"names": [], "commit": True, "weight_version": "40"})
    assert r.status_code == 200, r.text
    assert torch.equal(_param(engine_thread, "model.norm.weight"), torch.full((128,), 3.0))
    assert engine_thread.engine.weight_version == "40"


def test_every_output_matches_the_version_it_reports(trainer, engine_thread):
    """One-token requests race a commit; each logprob must come from exactly the weights its
    weight_version names - a half-applied update would match neither."""
    engine = engine_thread.engine
    prompt = [5, 6, 7, 8]

    def logprob_now() -> tuple[float, int]:
        r = httpx.post(engine_thread.url + "/generate", timeout=60, json={
            "input_ids": prompt, "return_logprob": True, "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
        m = r.json()["meta_info"]
        return m["output_token_logprobs"][0][0], m["weight_version"]

    old_lp, old_v = logprob_now()
    g = torch.Generator().manual_seed(0)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=g)
           for n, t in engine.model.state_dict().items() if n != "lm_head.weight"}
    results, stop = [], threading.Event()

    def hammer():
        while not stop.is_set():
            results.append(logprob_now())

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    while len(results) < 6:  # the race only means something once requests are flowing
        time.sleep(0.005)
    r = trainer.update(new, weight_version=str(from_wire(old_v) + 1))
    results.append(logprob_now())
    stop.set()
    for t in threads:
        t.join()
    assert r.status_code == 200, r.text
    new_lp, new_v = logprob_now()
    assert new_v == str(from_wire(old_v) + 1) and abs(new_lp - old_lp) > 1e-3
    for lp, v in results:
        assert v in (old_v, new_v)
        assert lp == pytest.approx(old_lp if v == old_v else new_lp, abs=1e-6)
    assert {v for _, v in results} == {old_v, new_v}


def _ptr(engine_thread, name: str) -> int:
    return dict(engine_thread.engine.model.named_parameters())[name].data_ptr()


def test_commit_adopts_received_memory_and_receives_into_the_displaced(trainer, engine_thread):
    """A broadcast update costs no copy into the parameters, and the next one lands in the memory
    the last one freed (no fresh pages), while values still follow the trainer exactly."""
    name = "model.layers.0.mlp.gate_proj.weight"
    shape = _param(engine_thread, name).shape
    first = torch.full(shape, 0.125)
    r = trainer.update({name: first}, reset_staging=True)
    assert r.status_code == 200, r.text
    ptrs = [_ptr(engine_thread, name)]
    for value in (0.25, 0.5):
        r = trainer.update({name: torch.full(shape, value)}, reset_staging=True)
        assert r.status_code == 200, r.text
        assert torch.equal(_param(engine_thread, name), torch.full(shape, value))
        ptrs.append(_ptr(engine_thread, name))
    assert ptrs[0] != ptrs[1] and ptrs[2] == ptrs[0]  # two buffers take turns


def test_memory_the_sender_can_still_write_is_copied_not_adopted(engine_thread, admin_token):
    """An engine's own p2p buffer is rewritten by the next version: the served weights must not live there."""
    from miles.sync import shm

    headers = {"Authorization": f"Bearer {admin_token}"}
    name = "model.layers.0.mlp.up_proj.weight"
    shape, dtype = tuple(_param(engine_thread, name).shape), _param(engine_thread, name).dtype
    new = torch.full(shape, 0.75, dtype=dtype)
    nbytes = new.numel() * new.element_size()
    path = httpx.post(engine_thread.url + "/p2p_open_buffer", json={"nbytes": nbytes}, headers=headers).json()["shm_path"]
    buf = shm.attach(path, nbytes)
    shm.write_bucket(buf, [(name, new)], [0])
    r = httpx.post(engine_thread.url + "/update_weights_from_tensor", headers=headers, timeout=60, json={
        "load_format": "shm", "shm_path": path, "names": [name], "dtypes": [str(dtype).removeprefix("torch.")],
        "shapes": [list(shape)], "offsets": [0], "commit": True, "reset_staging": True})
    assert r.status_code == 200, r.text
    buf.fill_(0)  # the trainer writing the next version
    assert torch.equal(_param(engine_thread, name), new)
    httpx.post(engine_thread.url + "/p2p_close_buffer", json={"shm_path": path}, headers=headers)


def test_p2p_versions_land_in_alternating_buffers_without_touching_served_weights(engine_thread, admin_token):
    """With p2p, a whole version becomes the parameters' memory at commit and the next version is
    written into the buffer they left: the served weights never change before commit, every version
    arrives bitwise, and the parameters alternate between two places (no copy on the engine)."""
    from miles.sync.prepare import buckets
    from miles.sync.transports import get_transport

    engine = engine_thread.engine
    base = {n: t.clone() for n, t in engine.model.state_dict().items() if n != "lm_head.weight"}
    transport = get_transport("p2p", admin_token=admin_token, timeout_s=60, buffer_bytes=16 << 20)
    transport.connect([engine_thread.url])
    name = "model.layers.1.self_attn.q_proj.weight"
    try:
        ptrs = []
        for version in (1, 2, 3):
            new = {n: t + 0.01 * version for n, t in base.items()}
            before = {n: t.clone() for n, t in engine.model.state_dict().items()}
            for bucket in buckets(iter(new.items()), 1 << 20):
                transport.send_bucket(bucket)
            for n, t in engine.model.state_dict().items():  # written, not committed: still the old version
                assert torch.equal(t, before[n]), n
            transport.commit(version)
            state = engine.model.state_dict()
            assert all(torch.equal(state[n], t) for n, t in new.items())
            assert engine.weight_version == str(version)
            ptrs.append(_ptr(engine_thread, name))
        assert ptrs[0] != ptrs[1] and ptrs[2] == ptrs[0]
    finally:
        transport.close()
