"""A batched /generate is queued in one go and waited on as one future: the whole group is prefilled in
one step, its results come back in order, and the first failure among them fails the batch."""

from __future__ import annotations

from concurrent.futures import CancelledError, Future

import pytest

from miles.engine_api.sampling import SamplingParams
from miles.engine.engine import _all_of


@pytest.fixture(scope="module")
def engine(model_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=model_dir))
    yield server.engine
    server.stop()


def test_a_batch_is_prefilled_in_one_step_and_answers_in_order(engine):
    prompts = [[11, 12, 13, 14 + k] for k in range(8)]
    alone = [engine.generate(p, SamplingParams(temperature=0.0, max_new_tokens=5)).output_ids for p in prompts]
    before = engine.runner.stats["prefill_forwards"]
    reqs = [engine.make_request(p, SamplingParams(temperature=0.0, max_new_tokens=5)) for p in prompts]
    results = engine.submit_all(reqs).result(120)
    assert [r.rid for r in results] == [r.rid for r in reqs]
    assert [r.output_ids for r in results] == alone
    # The scheduler found all eight waiting at once: one prefill, not one for the first and one for the rest.
    assert engine.runner.stats["prefill_forwards"] - before == 1
    assert engine.submit_all([]).result(5) == []


def test_the_first_failure_fails_the_batch_and_a_cancelled_waiter_is_left_alone():
    a, b, c = Future(), Future(), Future()
    out = _all_of([a, b, c])
    a.set_result(1)
    b.set_exception(RuntimeError("row b failed"))
    with pytest.raises(RuntimeError, match="row b failed"):
        out.result(1)
    c.set_result(3)  # a row answered after the batch failed changes nothing
    assert isinstance(out.exception(), RuntimeError)

    d, e = Future(), Future()
    waiting = _all_of([d, e])
    assert waiting.cancel()  # the HTTP client went away
    d.set_result(1)
    e.set_result(2)  # no error from the callbacks: the cancelled future stays cancelled
    with pytest.raises(CancelledError):
        waiting.result(1)
