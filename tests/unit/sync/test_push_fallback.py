"""No weight push hangs or silently does nothing: an engine that stalls mid-push (SIGSTOP: alive,
holding its port, answering nothing) fails the version at its deadline, the version is rolled back
(no engine commits it, so no engine is on a mixed version), and the next transport of sync.fallback
delivers it, verified, once the engine answers again; the metrics say so. A disk delta damaged after
it was written (fault.corrupt_delta_at_steps) is refused by the engines' checksums, rolled back and
sent again."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import torch

from miles.orchestration.faults import damage_delta
from miles.sync.prepare import SyncConfig
from miles.sync.transports import TransportError
from miles.sync.transports.delta_format import load_base
from miles.sync.transports.disk_delta import DiskDeltaConfig
from miles.sync.updater import WeightUpdater


def _relabel(urls, token):
    for url in urls:
        httpx.post(f"{url}/update_weight_version", json={"new_version": "default"}, timeout=60,
                   headers={"Authorization": f"Bearer {token}"}).raise_for_status()


def _state(base_model_dir, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: t + torch.randn(t.shape, generator=g) * 0.05 for n, t in load_base(base_model_dir).items()}


def test_a_stalled_engine_is_rolled_back_and_the_fallback_transport_delivers(engine_proc, engine_thread,
                                                                             base_model_dir, admin_token):
    urls = [engine_proc.url, engine_thread.url]
    _relabel(urls, admin_token)
    cfg = SyncConfig(transport="p2p", bucket_size_mb=1, timeout_s=3.0, version_timeout_s=30.0, retries=0,
                     fallback=["broadcast"], verify_first_update=False)
    updater = WeightUpdater(cfg, admin_token, base_path=base_model_dir)
    updater.connect(urls)
    state = _state(base_model_dir, seed=21)
    seen = {}

    def resume_later():
        time.sleep(5.0)
        seen["during_stall"] = engine_thread.engine.weight_version  # the engine that kept answering
        os.kill(engine_proc.proc.pid, signal.SIGCONT)

    os.kill(engine_proc.proc.pid, signal.SIGSTOP)
    waker = threading.Thread(target=resume_later, daemon=True)
    waker.start()
    t0 = time.monotonic()
    try:
        metrics = updater.push(iter(state.items()), version=7)
    finally:
        waker.join(10)
        os.kill(engine_proc.proc.pid, signal.SIGCONT)
        updater.close()
    assert time.monotonic() - t0 < 60
    assert seen["during_stall"] == "default"  # nothing committed while the other engine stalled
    assert metrics["sync/rollbacks"] == 1 and metrics["sync/fallbacks"] == 1, metrics
    assert metrics["sync/verified_buckets"] > 0  # the engines' checksums were compared with the trainer's
    for url in urls:
        assert httpx.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"] == "7"
    engine = engine_thread.engine.model.state_dict()
    assert all(torch.equal(engine[n], t) for n, t in state.items())


def test_when_every_attempt_fails_no_engine_moves_and_the_error_says_so(engine_proc, engine_thread,
                                                                        base_model_dir, admin_token):
    urls = [engine_proc.url, engine_thread.url]
    _relabel(urls, admin_token)
    cfg = SyncConfig(transport="p2p", bucket_size_mb=1, timeout_s=2.0, version_timeout_s=8.0, retries=1,
                     verify_first_update=False)
    updater = WeightUpdater(cfg, admin_token, base_path=base_model_dir)
    updater.connect(urls)
    os.kill(engine_proc.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(TransportError, match="failed on every attempt") as err:
            updater.push(iter(_state(base_model_dir, seed=22).items()), version=8)
        assert "attempt 2 over p2p" in str(err.value)
        assert time.monotonic() - t0 < 2 * (8.0 + 10.0) + 5  # two attempts, each within its deadline + rollback
        assert engine_thread.engine.weight_version == "default"
    finally:
        os.kill(engine_proc.proc.pid, signal.SIGCONT)
        updater.close()
    assert httpx.get(f"{engine_proc.url}/get_weight_version", timeout=30).json()["weight_version"] == "default"


def test_a_damaged_disk_delta_is_refused_rolled_back_and_sent_again(engine_proc, engine_thread, base_model_dir,
                                                                   admin_token, tmp_path):
    urls = [engine_proc.url, engine_thread.url]
    _relabel(urls, admin_token)
    cfg = DiskDeltaConfig(delta_dir=str(tmp_path / "deltas"), bucket_size_mb=1, timeout_s=30.0,
                          version_timeout_s=60.0, retries=1, verify_first_update=False)
    updater = WeightUpdater(cfg, admin_token, base_path=base_model_dir)
    updater.connect(urls)
    damaged = []
    state = _state(base_model_dir, seed=23)
    try:
        assert updater.tamper_next_version(lambda paths: (damaged.extend(paths), damage_delta(paths)))
        metrics = updater.push(iter(state.items()), version=9)
    finally:
        updater.close()
    assert len(damaged) == 1 and damaged[0].endswith("v00000009")  # the first attempt's files, once
    assert metrics["sync/rollbacks"] == 1 and "sync/fell_back" not in metrics, metrics
    assert metrics["sync/verified_buckets"] > 0
    for url in urls:
        assert httpx.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"] == "9"
    engine = engine_thread.engine.model.state_dict()
    assert all(torch.equal(engine[n], t) for n, t in state.items())


def test_a_transport_that_writes_no_files_cannot_be_tampered_with(base_model_dir, admin_token):
    updater = WeightUpdater(SyncConfig(transport="broadcast"), admin_token, base_path=base_model_dir)
    assert not updater.tamper_next_version(damage_delta)


def test_engines_are_held_through_the_commit_round_and_generate_again_once_every_one_committed(
        engine_thread, base_model_dir, admin_token):
    """The commit round's two phases: every engine staged the version, then every engine is held (paused in
    place) and answers before the commit is sent, and is continued only after every one committed."""
    import pickle

    from miles.sync.commit import FencedEngines

    url = engine_thread.url
    _relabel([url], admin_token)
    updater = WeightUpdater(SyncConfig(transport="p2p", bucket_size_mb=1, verify_first_update=False), admin_token,
                            base_path=base_model_dir)
    updater.connect([url])
    seen = {}
    updater.stall_before_commit(lambda: seen.update(paused=engine_thread.engine.paused,
                                                    version=engine_thread.engine.weight_version))
    try:
        updater.push(iter(_state(base_model_dir, seed=5).items()), version=3)
    finally:
        updater.close()
    assert seen == {"paused": True, "version": "default"}  # held, acknowledged, not yet committed
    assert not engine_thread.engine.paused and engine_thread.engine.weight_version == "3"
    (r,) = updater.rounds
    assert r.version == 3 and r.fenced == () and r.held_at <= r.released_at
    # What the fleet reads from a fenced push survives pickling (a trainer actor's error, through Ray).
    exc = FencedEngines("weight version 3: fenced")
    exc.version, exc.fenced = 3, ("http://a",)
    back = pickle.loads(pickle.dumps(exc))
    assert back.fenced == ("http://a",) and back.version == 3 and str(back) == "weight version 3: fenced"
