"""A step that raises where no check foresaw it fails only the request that causes it: the requests
batched with it finish with the greedy output they have without the fault, and the engine serves on.

The fault is injected at the model's forward (the edge between the engine and the network it runs):
it raises for a batch holding a marker token, past a position, or for a batch of several rows.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

HONEST = [[11, 12, 13, 14], [21, 22, 23, 24, 25, 26], [31, 32, 33], [41, 42, 43, 44, 45]]
NEW_TOKENS = 24
LONG = [11 + i % 50 for i in range(40)]  # a prompt whose decode crosses POSITION_LIMIT
POSITION_LIMIT = len(LONG) + 4


class Fault:
    """What makes the model's forward raise; None: nothing does."""

    def __init__(self):
        self.rule = None
        self.raised = 0

    def check(self, input_ids, position_ids) -> None:
        if self.rule is not None and self.rule(input_ids, position_ids):
            self.raised += 1
            raise RuntimeError("injected fault in the model forward")


@pytest.fixture(scope="module")
def served(model_dir):
    """(url, fault): an engine served from this process, its model's forward wrapped by the fault."""
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=model_dir))
    model, fault = server.engine.model, Fault()
    forward = model.forward

    def faulty_forward(*args, input_ids=None, position_ids=None, **kwargs):
        fault.check(input_ids, position_ids)
        return forward(*args, input_ids=input_ids, position_ids=position_ids, **kwargs)

    model.forward = faulty_forward
    yield server.url, fault
    server.stop()


@pytest.fixture
def fault(served):
    f = served[1]
    f.rule, f.raised = None, 0
    yield f
    f.rule = None


def _body(ids, n=NEW_TOKENS) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}}


def _post(url, body) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=120)


@pytest.fixture(scope="module")
def alone(served) -> list[list[int]]:
    """Each honest prompt's greedy output, sent alone to the engine without any fault."""
    return [_post(served[0], _body(ids)).json()["output_ids"] for ids in HONEST]


@pytest.fixture(scope="module")
def marker(served, alone, model_dir) -> int:
    """A token id that no honest prompt or output holds (and not the padding)."""
    from miles.models.loading import load_tokenizer

    used = {t for seq in HONEST + alone for t in seq} | {load_tokenizer(model_dir).pad_token_id}
    return next(t for t in range(100, 1000) if t not in used)


def _together(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """Send every body while generation is paused, then continue: all are admitted in one step."""
    httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=60).raise_for_status()
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(_post, url, b) for b in bodies]
            deadline = time.monotonic() + 60
            while httpx.get(f"{url}/get_load", timeout=30).json()["num_waiting_reqs"] < len(bodies):
                assert time.monotonic() < deadline, "the requests never queued"
                time.sleep(0.02)
            httpx.post(f"{url}/continue_generation", json={}, timeout=60).raise_for_status()
            return [f.result() for f in futures]
    finally:
        httpx.post(f"{url}/continue_generation", json={}, timeout=60)


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["engine_stats"]


def _serves_as_before(url: str, alone: list[list[int]]) -> None:
    """Nothing left in the batch or the queue, health green, and a full honest batch answered right."""
    load = httpx.get(f"{url}/get_load", timeout=30).json()
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 0), load
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
    again = _together(url, [_body(ids) for ids in HONEST])
    assert [r.json()["output_ids"] for r in again] == alone


def test_a_request_that_breaks_the_prefill_fails_alone_and_its_batch_finishes_as_without_it(served, fault,
                                                                                              alone, marker):
    url = served[0]
    fault.rule = lambda ids, _pos: bool((ids == marker).any())
    before = _stats(url)
    *honest, bad = _together(url, [_body(ids) for ids in HONEST] + [_body([5, marker, 6])])
    after = _stats(url)
    assert bad.status_code == 422, bad.text
    assert "injected fault" in bad.json()["error"] and "run alone" in bad.json()["error"]
    assert [r.status_code for r in honest] == [200] * len(HONEST), [r.text for r in honest]
    assert [r.json()["output_ids"] for r in honest] == alone
    # The fault hit a step that held every honest request; each then ran alone without failing, and
    # the marked one failed its own step.
    assert after["failed_steps"] - before["failed_steps"] == 2
    assert after["isolated_reqs"] - before["isolated_reqs"] == len(HONEST)
    assert after["failed_reqs"] - before["failed_reqs"] == 1
    fault.rule = None
    _serves_as_before(url, alone)


def test_a_request_that_breaks_a_decode_step_mid_generation_fails_alone(served, fault, alone):
    url = served[0]
    fault.rule = lambda _ids, pos: int(pos.max()) >= POSITION_LIMIT
    *honest, bad = _together(url, [_body(ids) for ids in HONEST] + [_body(LONG, n=16)])
    assert fault.raised >= 2  # in the batch's decode step, then in the long request's run alone
    assert bad.status_code == 422, bad.text
    assert [r.json()["output_ids"] for r in honest] == alone
    fault.rule = None
    _serves_as_before(url, alone)


def test_a_one_off_step_failure_costs_no_request(served, fault, alone):
    url = served[0]
    fault.rule = lambda ids, _pos: ids.shape[0] > 1 and fault.raised == 0
    honest = _together(url, [_body(ids) for ids in HONEST])
    assert fault.raised == 1
    assert [r.json()["output_ids"] for r in honest] == alone


def test_a_failure_no_single_request_causes_gets_503_retry_and_the_engine_serves_on(served, fault, alone):
    url = served[0]
    fault.rule = lambda ids, _pos: ids.shape[0] > 1  # only ever with two rows or more: nobody is to blame
    answers = _together(url, [_body(ids) for ids in HONEST])
    assert [r.status_code for r in answers] == [503] * len(HONEST), [r.text for r in answers]
    assert all("retry" in r.json()["error"] and r.headers["retry-after"] == "1" for r in answers)
    # Alone, each request still runs under the same fault.
    assert _post(url, _body(HONEST[0])).json()["output_ids"] == alone[0]
    fault.rule = None
    _serves_as_before(url, alone)
