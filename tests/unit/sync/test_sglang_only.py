"""The trainer against engines that speak only SGLang's protocol (built-in engines started with
`sglang_only`): broadcast runs over SGLang's routes with a pause around each push, verification runs
over SGLang's /weights_checker actions, and transports that need a miles extension are refused at
connect, naming the one that works. A push that fails midway is rolled back to the previous version
on every engine (disk), or stops naming the version each engine reports (broadcast)."""

from __future__ import annotations

import httpx
import pytest
import torch

from miles.config.loader import load_config
from miles.engine_api.errors import InvalidRequest
from miles.run_config import RunConfig
from miles.engine.config import EngineConfig
from miles.engine.server import start_server_thread
from miles.sync.transports import TransportError
from miles.sync.updater import MixedVersions, WeightUpdater
from miles.sync.verify import VerificationError


@pytest.fixture(scope="module")
def sglang_engines(base_model_dir, admin_token):
    servers = [start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=admin_token, sglang_only=True))
               for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def _state(model_dir: str, seed: int | None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (tied ones once), perturbed unless seed is None."""
    from miles.models.loading import load_model

    g = torch.Generator().manual_seed(seed or 0)
    out, seen = {}, set()
    for name, t in load_model(model_dir).state_dict().items():
        if t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t.clone() if seed is None else t + 0.05 * torch.randn(t.shape, generator=g)
    return out


def _updater(base_model_dir: str, admin_token: str, transport: str = "broadcast", **sync) -> WeightUpdater:
    overrides = {"model.path": base_model_dir, "sync.transport": transport, "sync.bucket_size_mb": "1",
                 **{f"sync.{k}": str(v).lower() if isinstance(v, bool) else str(v) for k, v in sync.items()}}
    return WeightUpdater(load_config(RunConfig, None, overrides).sync, admin_token, base_model_dir)


def _admin(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_an_sglang_only_engine_offers_no_extension_and_refuses_miles_fields(sglang_engines, admin_token):
    url = sglang_engines[0].url
    info = httpx.get(url + "/get_server_info").json()
    assert "miles_extensions" not in info and info["weight_version"] == "default"
    for path in ("/get_load", "/get_weight_version"):
        assert httpx.get(url + path).status_code == 404
    assert httpx.post(url + "/p2p_open_buffer", json={"nbytes": 64}, headers=_admin(admin_token)).status_code == 404
    plain = {"names": [], "dtypes": [], "shapes": []}
    r = httpx.post(url + "/update_weights_from_distributed", headers=_admin(admin_token), json=plain)
    assert r.status_code == 400 and "between begin_weight_update() and end_weight_update()" in r.json()["message"]
    assert httpx.post(url + "/begin_weight_update", headers=_admin(admin_token), json={}).status_code == 200
    try:
        r = httpx.post(url + "/update_weights_from_distributed", headers=_admin(admin_token),
                       json={**plain, "commit": False})
        assert r.status_code == 400 and r.json()["error"].startswith("commit: unknown field"), r.text
    finally:
        assert httpx.post(url + "/end_weight_update", headers=_admin(admin_token), json={}).status_code == 200
    r = httpx.post(url + "/weights_checker", headers=_admin(admin_token), json={"action": "compare", "expected": {}})
    assert r.status_code == 400 and r.json()["error"].startswith("expected: unknown field"), r.text


def test_broadcast_over_sglang_routes_verified_by_the_weights_checker(sglang_engines, base_model_dir, admin_token):
    urls = [s.url for s in sglang_engines]
    updater = _updater(base_model_dir, admin_token, verify_first_update=True, verify_checksums=True)
    updater.connect(urls)
    try:
        assert updater.plain and updater.needs_start_check
        metrics = updater.check_start(iter(_state(base_model_dir, None).items()))
        assert metrics["sync/buckets"] >= 2 and not updater.needs_start_check
        new = _state(base_model_dir, seed=3)
        metrics = updater.push(iter({n: t.clone() for n, t in new.items()}.items()), version=5)
        assert metrics["sync/verified_engines"] == 2
    finally:
        updater.close()
    # A trainer connecting later (a resumed run) finds the engines past their launch weights: the start
    # check, which needs them to hold the trainer's starting weights, is not attempted.
    later = _updater(base_model_dir, admin_token, verify_first_update=True)
    later.connect(urls)
    assert later.plain and not later.needs_start_check
    later.close()
    for server in sglang_engines:
        served = server.engine.model.state_dict()
        assert all(torch.equal(served[n], t) for n, t in new.items())
        assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == "5"
        # The push paused the engine and continued it: it generates again, under the new version.
        out = httpx.post(server.url + "/generate", timeout=60, json={
            "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
        assert out["meta_info"]["weight_version"] == "5"


class DroppingTransport:
    """A faulty wire: forwards every bucket but one tensor."""

    def __init__(self, inner, skip: str):
        self.inner, self.skip = inner, skip
        self.Receiver = getattr(inner, "Receiver", None)

    def send_bucket(self, bucket):
        self.inner.send_bucket([(n, t) for n, t in bucket if n != self.skip])

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_start_check_names_a_tensor_the_transport_never_wrote(sglang_engines, base_model_dir, admin_token):
    url = sglang_engines[0].url
    # Back to the checkpoint the trainer starts from, over SGLang's full reload (relabelled first:
    # versions never move backwards on their own).
    httpx.post(url + "/update_weight_version", headers=_admin(admin_token), timeout=60,
               json={"new_version": "default"}).raise_for_status()
    r = httpx.post(url + "/update_weights_from_disk", headers=_admin(admin_token), timeout=60,
                   json={"model_path": base_model_dir, "weight_version": "0"})
    assert r.status_code == 200 and r.json()["success"], r.text
    updater = _updater(base_model_dir, admin_token, verify_first_update=True)
    updater.connect([url])
    skip = "model.layers.0.mlp.up_proj.weight"
    updater.transport = DroppingTransport(updater.transport, skip)
    try:
        with pytest.raises(VerificationError, match=r"1 tensor\(s\) differ from the snapshot: " + skip):
            updater.check_start(iter(_state(base_model_dir, None).items()))
    finally:
        updater.close()
    assert sglang_engines[0].engine.paused is False  # the updater's pause is lifted
    # ... but the tensor that kept its noise is never served: no compare vouched for the weights.
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 503
    # A full reload outside a session overwrites every tensor, noise included: the engine serves again.
    r = httpx.post(url + "/update_weights_from_disk", headers=_admin(admin_token), timeout=60,
                   json={"model_path": base_model_dir, "weight_version": "0"})
    assert r.status_code == 200, r.text
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200


@pytest.mark.parametrize("transport", ["p2p", "disk_delta", "colocated"])
def test_transports_that_need_an_extension_are_refused_naming_broadcast(sglang_engines, base_model_dir,
                                                                        admin_token, transport, tmp_path):
    extra = {"delta_dir": tmp_path / "deltas"} if transport == "disk_delta" else {}
    updater = _updater(base_model_dir, admin_token, transport, **extra)
    with pytest.raises(TransportError, match=rf"'{transport}'.*use sync.transport = 'broadcast'"):
        updater.connect([sglang_engines[0].url])
    updater.close()


def test_disk_sync_over_sglang_full_reload(sglang_engines, base_model_dir, admin_token, tmp_path):
    """sync.transport = 'disk': each version a full checkpoint, loaded by SGLang's /update_weights_from_disk;
    the previous version's directory is removed once every engine loaded the next."""
    urls = [s.url for s in sglang_engines]
    updater = _updater(base_model_dir, admin_token, "disk", disk_dir=tmp_path / "weights", verify_checksums=True)
    updater.connect(urls)
    try:
        for version, seed in ((7, 7), (8, 8)):
            new = _state(base_model_dir, seed=seed)
            metrics = updater.push(iter({n: t.clone() for n, t in new.items()}.items()), version=version)
            assert metrics["sync/buckets"] >= 2 and metrics["sync/verified_engines"] == 2
            for server in sglang_engines:
                served = server.engine.model.state_dict()
                assert all(torch.equal(served[n], t) for n, t in new.items())
                assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == str(version)
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000008"]
    finally:
        updater.close()


def _relabel_default(urls, admin_token):
    """Engines shared by this module's tests start a new numbering (a load never moves a version back)."""
    for url in urls:
        httpx.post(url + "/update_weight_version", headers=_admin(admin_token), timeout=60,
                   json={"new_version": "default"}).raise_for_status()


def test_a_disk_push_one_engine_refuses_is_rolled_back_to_the_previous_version_on_every_engine(
        sglang_engines, base_model_dir, admin_token, tmp_path, monkeypatch):
    urls = [s.url for s in sglang_engines]
    _relabel_default(urls, admin_token)
    updater = _updater(base_model_dir, admin_token, "disk", disk_dir=tmp_path / "weights", verify_checksums=True)
    updater.connect(urls)
    refusing = sglang_engines[1].engine.receiver
    real_stage = refusing.stage_checkpoint

    def refuse_once(path):
        monkeypatch.setattr(refusing, "stage_checkpoint", real_stage)
        raise InvalidRequest("injected: the engine's disk is full")

    try:
        previous = _state(base_model_dir, seed=11)
        updater.push(iter({n: t.clone() for n, t in previous.items()}.items()), version=11)
        monkeypatch.setattr(refusing, "stage_checkpoint", refuse_once)
        with pytest.raises(TransportError, match=r"weight version 12 failed .*disk is full.*every engine was "
                                                 r"rolled back to version 11 .*and serves it") as err:
            updater.push(iter(_state(base_model_dir, seed=12).items()), version=12)
        assert not isinstance(err.value, MixedVersions)
        # The engine that loaded version 12 went back too: every engine holds version 11, and generates.
        for server in sglang_engines:
            served = server.engine.model.state_dict()
            assert all(torch.equal(served[n], t) for n, t in previous.items())
            assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == "11"
            assert server.engine.paused is False
            out = httpx.post(server.url + "/generate", timeout=60, json={
                "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
            assert out["meta_info"]["weight_version"] == "11"
        # The next push goes through as usual.
        updater.push(iter(_state(base_model_dir, seed=13).items()), version=13)
        assert {httpx.get(u + "/get_model_info").json()["weight_version"] for u in urls} == {"13"}
    finally:
        updater.close()


class FailingTransport:
    """A wire that fails after `after` buckets, as an engine that refuses or dies mid-push makes it."""

    def __init__(self, inner, after: int):
        self.inner, self.after, self.sent = inner, after, 0

    def send_bucket(self, bucket):
        if self.sent == self.after:
            raise TransportError("injected: engine refused bucket %d" % (self.sent + 1))
        self.inner.send_bucket(bucket)
        self.sent += 1

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_broadcast_push_that_fails_midway_stops_naming_the_version_each_engine_reports(
        sglang_engines, base_model_dir, admin_token):
    urls = [s.url for s in sglang_engines]
    _relabel_default(urls, admin_token)
    updater = _updater(base_model_dir, admin_token, verify_checksums=True)
    updater.connect(urls)
    try:
        updater.push(iter(_state(base_model_dir, seed=4).items()), version=4)
        working = updater.transport
        updater.transport = FailingTransport(working, after=2)
        with pytest.raises(MixedVersions, match=r"weight version 5 failed midway .*refused bucket 3.*keeps no copy "
                                                r"of the previous version.*stays paused") as err:
            updater.push(iter(_state(base_model_dir, seed=5).items()), version=5)
        assert err.value.held == {url: "4" for url in urls}
        assert all(f"{url}: 4" in str(err.value) for url in urls)
        # Two buckets of version 5 are in force under the label 4: nothing is generated from the mixture.
        assert all(server.engine.paused for server in sglang_engines)
        # A push that succeeds continues them, at its version.
        updater.transport = working
        new = _state(base_model_dir, seed=6)
        updater.push(iter({n: t.clone() for n, t in new.items()}.items()), version=6)
    finally:
        updater.close()
    for server in sglang_engines:
        assert server.engine.paused is False
        assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == "6"
        served = server.engine.model.state_dict()
        assert all(torch.equal(served[n], t) for n, t in new.items())


class StoppingTransport:
    """A wire during which an engine dies: `stop()` runs after `after` buckets."""

    def __init__(self, inner, after: int, stop):
        self.inner, self.after, self.stop, self.sent = inner, after, stop, 0

    def send_bucket(self, bucket):
        if self.sent == self.after:
            self.stop()
        self.inner.send_bucket(bucket)
        self.sent += 1

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_disk_push_an_engine_dies_in_cannot_be_rolled_back_there_and_stops_naming_each_version(
        sglang_engines, base_model_dir, admin_token, tmp_path):
    doomed = start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=admin_token, sglang_only=True))
    urls = [s.url for s in sglang_engines]
    _relabel_default(urls, admin_token)
    updater = _updater(base_model_dir, admin_token, "disk", disk_dir=tmp_path / "weights", timeout_s=10)
    updater.connect([*urls, doomed.url])
    try:
        updater.push(iter(_state(base_model_dir, seed=21).items()), version=21)
        updater.transport = StoppingTransport(updater.transport, after=1, stop=doomed.stop)
        with pytest.raises(MixedVersions, match=r"weight version 22 failed midway .*rolling back failed: "
                                                r"reloading version 21 .* failed on " + doomed.url) as err:
            updater.push(iter(_state(base_model_dir, seed=22).items()), version=22)
        held = err.value.held
        assert {held[u] for u in urls} == {"21"} and held[doomed.url].startswith("no answer"), held
        assert all(server.engine.paused for server in sglang_engines)
        # Without the dead engine (the fleet routes around it), the next push continues the others.
        updater.transport = updater.transport.inner
        updater.connect(urls)
        updater.push(iter(_state(base_model_dir, seed=23).items()), version=23)
    finally:
        updater.close()
        doomed.stop()
    for server in sglang_engines:
        assert server.engine.paused is False
        assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == "23"
