"""/generate with `stream: true`: the engine sends each step's tokens as it samples them (SGLang's
default chunks: everything so far in each), and a client that leaves early frees the request's slot."""

from __future__ import annotations

import json
import time

import httpx


def _events(lines) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_streamed_generate_sends_every_token_as_sampled_and_ends_with_the_unstreamed_result(engine_url):
    body = {"input_ids": [5, 9, 14, 3], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}}
    whole = httpx.post(f"{engine_url}/generate", json=body, timeout=120).json()
    with httpx.stream("POST", f"{engine_url}/generate", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks, last = events[:-2], events[-2]
    # One chunk per sampled token (prefill gives the first), each holding all the ids so far, then
    # the finished result (the unstreamed body) with its finish reason.
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 11))
    assert all(c["output_ids"] == whole["output_ids"][:len(c["output_ids"])] for c in chunks)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks)
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert [t for _, t, _ in last["meta_info"]["output_token_logprobs"]] == whole["output_ids"]
    assert [lp for lp, _, _ in chunks[4]["meta_info"]["output_token_logprobs"]] == \
        [lp for lp, _, _ in whole["meta_info"]["output_token_logprobs"][:5]]


def _generated(engine_url) -> float:
    text = httpx.get(f"{engine_url}/metrics").text
    return float(next(l.split()[1] for l in text.splitlines() if l.startswith("miles_engine_generated_tokens_total")))


def test_the_first_chunk_arrives_while_the_request_still_runs_and_leaving_early_aborts_it(engine_url):
    before = _generated(engine_url)
    body = {"input_ids": [7, 8, 9], "stream": True, "rid": "long-stream",
            "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}}
    with httpx.stream("POST", f"{engine_url}/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response
        first = _events([next(lines)])[0]
        assert len(first["output_ids"]) < 400 and first["meta_info"]["finish_reason"] is None
        load = httpx.get(f"{engine_url}/get_load").json()
        assert load["num_running_reqs"] == 1, load  # still generating
    # The client went away after one chunk: the engine stops the request instead of running 400 steps.
    deadline = time.monotonic() + 30
    while httpx.get(f"{engine_url}/get_load").json()["num_reqs"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{engine_url}/get_load").json()["num_reqs"] == 0
    assert _generated(engine_url) - before < 400
