"""The engine fleet over real engine processes, a real router and real weight pushes: a stalled
engine (SIGSTOP: alive, holding its port, answering nothing) is found, killed and replaced by an
engine brought to the fleet's weight version, while the router keeps serving; engines are added
and removed while it runs. Engines the run did not start are routed around while dead and
re-admitted, at the fleet's weights, once their operator restarts them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

TOKEN = "fleet-test-token"


@contextlib.contextmanager
def _running_fleet(model_dir, engines, start, sync_cfg=None):
    """A fleet over `engines` at weight version 1 behind a real router, its monitor running; `.main` is
    the main weight updater and `.weights` the "trainer's" weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.orchestration.fleet import EngineFleet
    from miles.rollout.liveness import HealthConfig
    from miles.rollout.router import RouterConfig, start_router_thread
    from miles.sync.prepare import SyncConfig
    from miles.sync.updater import WeightUpdater

    torch.set_num_threads(1)
    # The "trainer": the same checkpoint with every weight moved, so a pushed engine differs from a fresh one.
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    weights = dict(model.state_dict())
    sync_cfg = sync_cfg or SyncConfig(bucket_size_mb=1)
    main = WeightUpdater(sync_cfg, TOKEN, base_path=model_dir)
    main.connect([e.url for e in engines])
    main.push(iter(weights.items()), 1)  # the fleet's weight version is 1
    router = start_router_thread(RouterConfig(admin_token=TOKEN), [e.url for e in engines], HealthConfig(interval_s=0.2))
    pushed: list[str] = []
    fleet_version = {"now": 1}  # the version a new engine is brought up at (a test that pushes another sets it)

    def bring_up(url: str) -> None:
        new = WeightUpdater(sync_cfg, TOKEN, base_path=model_dir)  # noise-fills and verifies every tensor
        new.connect([url])
        new.push(iter(weights.items()), fleet_version["now"])
        new.close()
        pushed.append(url)

    f = EngineFleet(HealthConfig(interval_s=0.3, timeout_s=1.5, failure_threshold=2), start, router.url, TOKEN,
                    bring_up=bring_up, reconnect=main.connect)
    f.adopt(engines)
    f.start_monitor()
    f.pushed, f.router, f.main, f.weights, f.version = pushed, router, main, weights, fleet_version
    try:
        yield f
    finally:
        f.close()
        router.stop()
        main.close()


def _engine_process(model_dir, port: int = 0):
    from miles.engine.process import EngineProcess

    return EngineProcess(model_dir, port=port, admin_token=TOKEN, extra_args=["--num-threads", "1"])


def _starter(model_dir):
    """start(slot) -> a fresh engine process's handle, as the fleet's engine starter."""
    from miles.orchestration.fleet import EngineHandle

    def start(slot: int) -> EngineHandle:
        proc = _engine_process(model_dir)
        return EngineHandle(proc.url, proc.proc.pid, proc.stop)

    return start


@pytest.fixture()
def fleet(tiny_model_dir):
    start = _starter(tiny_model_dir)
    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(start, [0, 1]))
    with _running_fleet(tiny_model_dir, engines, start) as f:
        yield f


def _generate(url: str) -> httpx.Response:
    return httpx.post(url + "/generate", timeout=60, json={
        "input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 4}})


def _active(router_url: str) -> list[str]:
    return [w["url"] for w in httpx.get(router_url + "/list_workers").json()["workers"] if not w["quarantined"]]


def test_a_stalled_engine_is_detected_replaced_and_admitted_at_the_fleet_version(fleet):
    from miles.orchestration.faults import FaultInjector
    from miles.run_sections import FaultConfig

    injector = FaultInjector(FaultConfig(seed=1), fleet)
    fault = injector.engine_fault("stall_engine")  # SIGSTOP one of the two
    stalled = next(e for _, e in fleet.serving() if e.pid == fault.pid)
    survivor = next(e for _, e in fleet.serving() if e.pid != fault.pid)
    t0 = time.monotonic()
    while not (fleet.replacements and fleet.replacements[0].admitted_at) and time.monotonic() - t0 < 120:
        # The router keeps answering meanwhile, from the engine that still works.
        assert _generate(fleet.router_url).status_code == 200
        time.sleep(0.2)
    rec = fleet.replacements[0]
    assert rec.admitted_at is not None, rec
    assert rec.old_url == stalled.url and "no answer within" in rec.reason, rec.reason
    assert rec.detected_at - rec.first_miss < 10  # two missed probe rounds, not a long hang
    report = injector.report([r.public() for r in fleet.replacements])
    assert report["stalls"] == 1 and report["recovered"] == 1 and report["mean_recovery_s"] > 0
    with pytest.raises(ProcessLookupError):  # SIGKILLed, not left stopped
        os.kill(stalled.pid, 0)

    new_url = rec.new_url
    assert fleet.pushed == [new_url]  # fully pushed (and verified) before admission
    assert httpx.get(new_url + "/get_weight_version").json()["weight_version"] in (1, "1")
    assert sorted(fleet.serving_urls()) == sorted([survivor.url, new_url])
    assert sorted(_active(fleet.router_url)) == sorted([survivor.url, new_url])
    # The replacement generates exactly what the survivor does: same weights.
    assert _generate(new_url).json()["output_ids"] == _generate(survivor.url).json()["output_ids"]

    # Elastic: grow by one engine, then shrink by one, while the router serves.
    added = fleet.add_engine()
    assert added in _active(fleet.router_url) and len(fleet.serving_urls()) == 3
    fleet.remove_engine(survivor.url)
    assert sorted(_active(fleet.router_url)) == sorted([new_url, added])
    assert _generate(fleet.router_url).status_code == 200
    with pytest.raises(ValueError, match="not a serving engine"):
        fleet.remove_engine(survivor.url)

    # Injected dropped replies: the client gets a 502 that says so, not a hang or a wrong answer.
    fleet.router.router.response_fault = FaultInjector(FaultConfig(drop_response_prob=0.99), fleet).drop_response
    r = _generate(fleet.router_url)
    assert r.status_code == 502 and "dropped (fault injection)" in r.text


def test_a_push_an_engine_stalls_in_for_good_is_rolled_back_and_made_again_without_it(tiny_model_dir):
    import signal

    from miles.sync.prepare import SyncConfig

    start = _starter(tiny_model_dir)
    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(start, [0, 1]))
    cfg = SyncConfig(bucket_size_mb=1, timeout_s=5.0, version_timeout_s=30.0, retries=0)
    with _running_fleet(tiny_model_dir, engines, start, cfg) as f:
        stalled, survivor = engines
        os.kill(stalled.pid, signal.SIGSTOP)  # as the push starts (fault.stall_engine_at_steps), never resumed
        t0 = time.monotonic()
        with f.weights_lock:
            metrics = f.push(lambda: f.main.push(iter(f.weights.items()), 2))
        assert time.monotonic() - t0 < 120
        assert metrics["sync/engine_loss_retries"] >= 1, metrics  # the version went again, to the engine serving
        assert metrics["sync/verified_buckets"] > 0
        assert stalled.url not in f.serving_urls()
        assert httpx.get(survivor.url + "/get_weight_version").json()["weight_version"] in (2, "2")
        with pytest.raises(ProcessLookupError):  # SIGKILLed by the fleet, not left stopped
            os.kill(stalled.pid, 0)


def test_an_engine_stalled_between_readiness_and_commit_is_fenced_and_no_answer_is_at_a_non_fleet_version(
        tiny_model_dir):
    """fault.stall_engine_at_commit: one engine is SIGSTOPped after every engine acknowledged the commit
    round's readiness, right before its commit. The other commits; the straggler does not acknowledge in
    time, is fenced (held, out of the router, killed and replaced) and the version is made again without
    it. Meanwhile clients generate through the router: every answer's weight versions are the fleet's at
    its generation (an old version only from before the commit round, none from an engine left behind)."""
    import signal
    import threading

    from miles.orchestration.faults import FaultInjector
    from miles.run_sections import FaultConfig
    from miles.rollout.generate import versions_of
    from miles.sync.prepare import SyncConfig

    start = _starter(tiny_model_dir)
    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(start, [0, 1]))
    cfg = SyncConfig(bucket_size_mb=1, timeout_s=3.0, version_timeout_s=60.0, retries=0)
    with _running_fleet(tiny_model_dir, engines, start, cfg) as f:
        class Trainer:  # the trainer group's fault hook (TrainerShell.stall_next_commit), on this "trainer"
            def stall_next_commit(self, pid):
                f.main.stall_before_commit(lambda: os.kill(pid, signal.SIGSTOP))
                return True

        answers, stop = [], threading.Event()

        def client():
            while not stop.is_set():
                t0 = time.time()
                try:
                    r = _generate(f.router_url)
                except httpx.HTTPError:
                    continue
                if r.status_code == 200:
                    answers.append((t0, time.time(), versions_of(r.json()["meta_info"])))

        clients = [threading.Thread(target=client, daemon=True) for _ in range(2)]
        for c in clients:
            c.start()
        time.sleep(1.0)
        injector = FaultInjector(FaultConfig(stall_engine_at_commit=[2], seed=3), f)
        injector.before_push(2, Trainer())
        fault = injector.faults[0]
        assert fault.kind == "stall_engine_at_commit"
        stalled = next(e for e in engines if e.pid == fault.pid)
        survivor = next(e for e in engines if e.pid != fault.pid)
        f.version["now"] = 2
        with f.weights_lock:
            metrics = f.push(lambda: f.main.push(iter(f.weights.items()), 2))
        time.sleep(1.0)  # answers after the push, from the engine serving
        stop.set()
        for c in clients:
            c.join(60)

        assert metrics["sync/fenced_engines"] == 1 and metrics["sync/engine_loss_retries"] >= 1, metrics
        assert metrics["sync/verified_buckets"] > 0  # the version made again without it, checksum-verified
        first, *_ = [r for r in f.main.rounds if r.version == 2]
        assert first.fenced == (stalled.url,)  # the round the others committed in, without it
        assert stalled.url not in f.serving_urls() and stalled.url not in _active(f.router_url)
        # Taken out by the fence, or by the health monitor first when its probes missed during the round.
        assert any(r.old_url == stalled.url for r in f.replacements)
        with pytest.raises(ProcessLookupError):  # killed by the fleet, not left stopped
            os.kill(stalled.pid, 0)
        assert httpx.get(survivor.url + "/get_weight_version").json()["weight_version"] in (2, "2")

        # The fleet's version at each moment: 1 until the round's hold, nothing generated during it, 2 after.
        assert answers and any(2 in v for *_, v in answers), answers
        for sent, done, versions in answers:
            assert set(versions) <= {1, 2}, versions
            if 1 in versions:  # tokens of version 1 only from before the hold: the request came earlier
                assert sent < first.held_at, (sent, first, versions)
            if 2 in versions:
                assert done >= first.released_at, (done, first, versions)


def test_engines_fenced_in_a_trainer_rank_are_named_through_rays_and_the_trainer_groups_wrapping():
    """A run's push fails in a trainer rank: FencedEngines arrives inside Ray's error inside the trainer
    group's TrainerFailure, and the fleet must still fence exactly those engines (sync/fenced_engines)."""
    from ray.exceptions import RayTaskError

    from miles.orchestration.fleet.fleet import _fenced_by
    from miles.orchestration.trainer_group import TrainerFailure
    from miles.sync.commit import FencedEngines

    inner = FencedEngines("weight version 3 was committed on [] but not acknowledged in time")
    inner.version, inner.fenced = 3, ("http://127.0.0.1:5",)
    try:
        raise TrainerFailure("trainer rank 0 failed in sync_weights") from RayTaskError(
            "sync_weights", "traceback", inner).as_instanceof_cause()
    except TrainerFailure as exc:
        assert _fenced_by(exc) == ("http://127.0.0.1:5",)
    assert _fenced_by(RuntimeError("an engine is not answering")) == ()


@pytest.mark.slow
def test_an_engine_started_outside_the_run_is_routed_around_and_readmitted_after_its_restart(tiny_model_dir):
    """rollout.engine_urls engines: miles cannot restart a dead one, so it routes around it, keeps probing,
    and when its operator has started it again on the same port, pushes it the fleet's weights before
    the router gives it traffic."""
    from miles.orchestration.fleet import EngineHandle

    def start(slot: int):
        raise AssertionError("the fleet must never start an engine in place of one it did not start")

    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda _: _engine_process(tiny_model_dir), [0, 1]))
    try:
        with _running_fleet(tiny_model_dir, [EngineHandle.outside(p.url) for p in procs], start) as fleet:
            dead, survivor = procs
            port = int(dead.url.rsplit(":", 1)[1])
            dead.proc.kill()
            dead.proc.wait()
            t0 = time.monotonic()
            # Down once routed around (its record is written a moment before the router is told).
            while fleet.slots[0].state != "down" and time.monotonic() - t0 < 30:
                assert _generate(fleet.router_url).status_code == 200  # served by the survivor meanwhile
                time.sleep(0.2)
            rec = fleet.replacements[0]
            assert rec.kind == "readmitted" and rec.old_url == dead.url and rec.admitted_at is None
            assert fleet.serving_urls() == [survivor.url] and _active(fleet.router_url) == [survivor.url]
            time.sleep(1.0)  # still down: probed every round, never replaced
            assert [s.state for s in fleet.slots] == ["down", "serving"] and fleet.pushed == []

            # Probe rounds 5 s apart from here: the round that finds it answering readmits it, and no later
            # round reads its version before the checks below.
            fleet.cfg = dataclasses.replace(fleet.cfg, interval_s=5.0)
            procs[0] = _engine_process(tiny_model_dir, port)  # its operator starts it again, same address
            assert procs[0].url == dead.url
            t0 = time.monotonic()
            while rec.admitted_at is None and time.monotonic() - t0 < 60:
                time.sleep(0.1)
            assert rec.admitted_at is not None, rec
            # Known to hold the pushed version from its admission on, not from the next probe round's read:
            # restarted again before that round, it would otherwise go unnoticed.
            assert fleet.slots[0].holds_pushed
            fleet.cfg = dataclasses.replace(fleet.cfg, interval_s=0.3)
            assert rec.error is None and rec.new_url == dead.url and fleet.error is None
            assert fleet.pushed == [dead.url]  # caught up before admission
            assert httpx.get(dead.url + "/get_weight_version").json()["weight_version"] in (1, "1")
            assert sorted(_active(fleet.router_url)) == sorted([dead.url, survivor.url])
            assert sorted(fleet.serving_urls()) == sorted([dead.url, survivor.url])
            assert _generate(dead.url).json()["output_ids"] == _generate(survivor.url).json()["output_ids"]
            assert fleet.report()["readmissions"] == 1

            # Restarted faster than the probes count misses (here: never enough misses): the engine's
            # weight version gives it away ("default" where miles had pushed "1"), and it is caught up again.
            fleet.cfg = dataclasses.replace(fleet.cfg, failure_threshold=10**6)
            procs[0].proc.kill()
            procs[0].proc.wait()
            procs[0] = _engine_process(tiny_model_dir, port)
            t0 = time.monotonic()
            while not (len(fleet.replacements) == 2 and fleet.replacements[1].admitted_at) \
                    and time.monotonic() - t0 < 60:
                time.sleep(0.1)
            again = fleet.replacements[1]
            assert again.admitted_at is not None and again.reason.startswith("restarted"), again
            assert fleet.pushed == [dead.url, dead.url] and fleet.report()["readmissions"] == 2
            assert httpx.get(dead.url + "/get_weight_version").json()["weight_version"] in (1, "1")
            assert sorted(_active(fleet.router_url)) == sorted([dead.url, survivor.url])
        # The fleet never stops engines it did not start.
        assert all(p.proc.poll() is None for p in procs)
    finally:
        for p in procs:
            p.stop()


def test_a_replacement_engine_joins_a_disk_delta_run_at_the_fleet_version(tiny_model_dir, tmp_path):
    """disk_delta engines patch a local copy version by version; a replacement starts from the base, is
    sent the next version as one catch-up delta from the base, and then holds exactly the fleet's weights."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from miles.orchestration.faults import FaultInjector
    from miles.run_sections import FaultConfig
    from miles.orchestration.fleet import EngineFleet, EngineHandle
    from miles.engine.process import EngineProcess
    from miles.rollout.liveness import HealthConfig
    from miles.rollout.router import RouterConfig, start_router_thread
    from miles.sync import verify
    from miles.engine_api.client import EngineClient
    from miles.sync.transports.delta_format import load_base, version_dir
    from miles.sync.transports.disk_delta import DiskDeltaConfig
    from miles.sync.updater import WeightUpdater

    torch.set_num_threads(1)
    base = load_base(tiny_model_dir)

    def weights(version: int) -> dict:  # what the "trainer" holds at each version: every tensor moved
        return {n: t + 0.01 * version for n, t in base.items()}

    cfg = DiskDeltaConfig(delta_dir=str(tmp_path / "deltas"), bucket_size_mb=1)
    current = {"version": 0}

    def start(slot: int) -> EngineHandle:
        proc = EngineProcess(tiny_model_dir, admin_token=TOKEN, extra_args=["--num-threads", "1"])
        return EngineHandle(proc.url, proc.proc.pid, proc.stop)

    def push(updater, version: int) -> None:
        updater.push(iter(weights(version).items()), version)
        current["version"] = version

    def bring_up(url: str) -> None:  # as the trainer's push_full does: a fresh, fully verified push
        new = WeightUpdater(cfg.for_new_engines(), TOKEN, base_path=tiny_model_dir)
        new.connect([url])
        new.push(iter(weights(current["version"]).items()), current["version"])
        new.close()

    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(start, [0, 1]))
    main = WeightUpdater(cfg, TOKEN, base_path=tiny_model_dir)
    main.connect([e.url for e in engines])
    push(main, 1)
    push(main, 2)  # the fleet is two deltas past the base
    router = start_router_thread(RouterConfig(admin_token=TOKEN), [e.url for e in engines], HealthConfig(interval_s=0.2))
    fleet = EngineFleet(HealthConfig(interval_s=0.3, timeout_s=1.5, failure_threshold=2), start, router.url, TOKEN,
                        bring_up=bring_up, reconnect=main.connect)
    fleet.adopt(engines)
    fleet.start_monitor()
    client = EngineClient(admin_token=TOKEN)
    try:
        killed = FaultInjector(FaultConfig(seed=3), fleet).engine_fault("kill_engine")
        t0 = time.monotonic()
        while not (fleet.replacements and fleet.replacements[0].admitted_at) and time.monotonic() - t0 < 120:
            time.sleep(0.2)
        rec = fleet.replacements[0]
        assert rec.admitted_at is not None and rec.old_pid == killed.pid, rec
        # The bring-up push wrote under its own directory: the run's version 2 is the one engines applied.
        assert json.load(open(os.path.join(version_dir(cfg.delta_dir, 2), "index.json")))["base_version"] == 1

        with fleet.weights_lock:
            fleet.push(lambda: push(main, 3))  # reconnects the transport to the replacement first
        urls = fleet.serving_urls()
        assert rec.new_url in urls and sorted(main.engine_urls) == sorted(urls)
        assert [client.get(u, "/get_weight_version")["weight_version"] for u in urls] == ["3", "3"]
        # The replacement committed version 3 with the fleet and holds exactly its weights.
        verify.compare_across_engines(client, urls)
        survivor = next(u for u in urls if u != rec.new_url)
        tables = [verify._table(client.post(u, "/weights_checker", {"action": "checksum"})) for u in urls]
        assert tables[0] == tables[1] and len(tables[0]) == len(base)
        assert _generate(rec.new_url).json()["output_ids"] == _generate(survivor).json()["output_ids"]
        assert not os.path.exists(os.path.join(cfg.delta_dir, "join"))  # the catch-up is gone once committed

        push(main, 4)  # and from there on it takes the regular deltas like every other engine
        assert [client.get(u, "/get_weight_version")["weight_version"] for u in urls] == ["4", "4"]
    finally:
        client.close()
        fleet.close()
        router.stop()
        main.close()


def test_a_replacement_whose_bring_up_fails_starts_over_with_another_engine(fleet, monkeypatch):
    """The trainer group dying in the middle of a replacement's weight push (here: the push raises once)
    does not end the run: that engine is killed and the replacement starts over after a pause."""
    import signal

    from miles.orchestration.fleet import replacement

    monkeypatch.setattr(replacement, "REPLACE_PAUSE_S", 0.5)
    push, tried = fleet.bring_up, []

    def failing_once(url: str) -> None:
        tried.append(url)
        if len(tried) == 1:
            raise RuntimeError("trainer rank 0 failed in push_full: the actor is dead")
        push(url)

    fleet.bring_up = failing_once
    _, victim = fleet.serving()[0]
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    while not (fleet.replacements and fleet.replacements[0].admitted_at) and time.monotonic() - t0 < 120:
        assert fleet.error is None, fleet.error
        time.sleep(0.2)
    rec = fleet.replacements[0]
    assert rec.admitted_at is not None and fleet.error is None, (rec, fleet.error)
    assert len(tried) == 2 and tried[1] == rec.new_url != tried[0]
    assert fleet.pushed == [rec.new_url]  # only the engine that was admitted holds the pushed weights
    assert rec.new_url in fleet.serving_urls() and tried[0] not in fleet.serving_urls()
    with pytest.raises(httpx.TransportError):  # the engine of the failed try was stopped
        httpx.get(tried[0] + "/health", timeout=2)
