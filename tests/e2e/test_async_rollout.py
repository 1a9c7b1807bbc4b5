"""The fully-async producer against real HTTP engines: induced timeouts, engine failures and aborts
end as retries or reasoned discards (the ledger balances), and partial rollout resumes aborted
samples from their prefix with one weight version per segment."""

import socket
import threading
import time

import httpx
import pytest

from miles.net import free_port

pytestmark = pytest.mark.e2e

TOKEN = "rollout-test-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=tiny_model_dir, num_threads=1, admin_token=TOKEN))
    yield server
    server.stop()


@pytest.fixture
def hanging_url():
    """An 'engine' that accepts connections and never answers (a stuck server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held, stop = [], threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    for c in held:
        c.close()
    sock.close()


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def manager(model_dir, urls, rollout=None, buffer=None, router_url=None):
    from miles.buffer.data_buffer import BufferConfig
    from miles.rollout.config import RolloutConfig
    from miles.rollout.manager import RolloutManager

    rcfg = RolloutConfig(**{"prompts_per_step": 2, "n_samples_per_prompt": 2, "max_new_tokens": 8, **(rollout or {})})
    bcfg = BufferConfig(**{"filter": "none", "max_inflight_groups": 3, "max_retries": 1, **(buffer or {})})
    return RolloutManager(rcfg, model_dir, urls, seed=0, buffer_cfg=bcfg,
                          admin_token=TOKEN, router_url=router_url)


def wait_until_running(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/get_load").json()["num_running_reqs"] > 0:
            return
        time.sleep(0.005)
    raise AssertionError("the engine never started decoding")


def abort_until_seen(m, url: str, timeout: float = 60.0) -> None:
    """Abort everything the engine is decoding until one group comes back aborted. An abort can land
    between two requests of a group and catch nothing (more often on a loaded machine), so it is
    tried again until one lands."""
    deadline = time.monotonic() + timeout
    while m.buffer.ledger.events["retried_aborted"] == 0:
        assert time.monotonic() < deadline, "no abort reached a group"
        wait_until_running(url)
        httpx.post(f"{url}/abort_request", json={"abort_all": True}, headers=ADMIN).raise_for_status()
        time.sleep(0.2)


def test_ledger_balances_after_timeouts_engine_failures_and_aborts(tiny_model_dir, engine, hanging_url):
    m = manager(tiny_model_dir, [engine.url, hanging_url, dead_url()],
                rollout={"group_timeout_s": 3.0, "max_new_tokens": 16})
    m.start_producer()
    try:
        abort_until_seen(m, engine.url)
        trained = []
        for _ in range(3):
            groups, metrics = m.collect(2, timeout=60)
            trained += groups
    finally:
        m.stop_producer()
    assert len(trained) == 6 and all(g.failure is None and len(g.samples) == 2 for g in trained)
    totals = m.ledger()  # raises if the ledger does not balance
    assert totals["drawn"] == totals["trained"] + totals["discarded"] + totals["pending"]
    events = m.buffer.ledger.events
    assert events["retried_timeout"] >= 1, dict(events)          # the hanging engine
    assert events["retried_engine_failure"] >= 1, dict(events)   # the dead one
    assert events["retried_aborted"] >= 1, dict(events)          # the abort we sent
    # Retried prompts that failed again were discarded with their reason, never lost.
    assert totals["discarded"] == sum(v for k, v in events.items() if k.startswith("discarded_"))
    assert metrics["buffer/trained"] == 6


def test_partial_rollout_resumes_aborted_samples_with_per_segment_versions(tiny_model_dir, engine):
    m = manager(tiny_model_dir, [engine.url], rollout={"partial_rollout": True, "max_new_tokens": 128},
                buffer={"max_inflight_groups": 2})
    m.start_producer()
    try:
        wait_until_running(engine.url)
        # Paused in place, the running samples cannot finish before the abort, however fast the machine.
        engine.engine.pause("in_place")
        engine.engine.apply_weights({}, 1)  # a new policy version lands mid-generation
        m.set_versions(1, 1)
        httpx.post(f"{engine.url}/abort_request", json={"abort_all": True}, headers=ADMIN).raise_for_status()
        engine.engine.continue_generation()
        groups, _ = m.collect(2, timeout=60)
        retried_before_stop = m.buffer.ledger.events["retried_aborted"]
    finally:
        engine.engine.continue_generation()
        m.stop_producer()
        engine.engine.apply_weights({}, 0)
    resumed = [s for g in groups for s in g.samples if len(s.weight_versions) > 1]
    assert resumed, "no aborted sample was resumed"
    for s in resumed:
        assert s.weight_versions == [0, 1]  # the prefix under version 0, the rest under version 1
        assert s.status.value != "aborted"
        assert len(s.response_ids) == len(s.rollout_logprobs) == len(s.loss_mask)
    assert retried_before_stop == 0  # resumed, not retried (stopping the producer aborts for good)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per_group"])
def test_a_group_is_one_batched_request_equal_to_its_samples_sent_alone(tiny_model_dir, engine, merge):
    import asyncio

    from miles.rollout.generate import generate
    from miles.rollout.router import RouterConfig, start_router_thread

    router = start_router_thread(RouterConfig(), [engine.url])
    try:
        m = manager(tiny_model_dir, [engine.url], router_url=router.url,
                    rollout={"n_samples_per_prompt": 4, "max_new_tokens": 12, "merge_requests": merge})
        m.generate_batch()
        groups, _ = m.collect(2, timeout=60)
        # Never one per sample: the step's two groups in one POST (rollout.merge_requests), else one each.
        assert router.router.counters.requests == (1 if merge else 2)
    finally:
        router.stop()

    async def alone(prompt_ids, params):
        async with httpx.AsyncClient(timeout=60) as c:
            return await generate(c, engine.url, prompt_ids, params)

    for g in groups:
        assert len(g.samples) == 4
        for k, s in enumerate(g.samples):  # in order, each with its own seeded sampling parameters
            single = asyncio.run(alone(s.prompt_ids, m.groups.sampling_params(g.prompt_index, k)))
            assert s.response_ids == single.response_ids
            assert s.rollout_logprobs == pytest.approx(single.rollout_logprobs, abs=1e-4)
