"""Each request stops on its own: EOS, stop_token_ids, stop strings, max_new_tokens, context length, abort."""

from __future__ import annotations

import threading
import time

import pytest

CANDIDATES = ["999+1=", "47+38=", "1+2=", "The trainer computes a policy", "ls cat echo grep python file",
              "7*8=", "12+30=", "answer question"]


def _gen(client, ids, **sp):
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"temperature": 0, **sp}})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def eos_case(tokenizer, ref):
    """A prompt whose greedy continuation reaches EOS within 40 tokens."""
    for p in CANDIDATES:
        ids = tokenizer.encode(p)
        out = ref.greedy(ids, 40)
        if out[-1] == tokenizer.eos_token_id:
            return ids, out
    pytest.fail("no candidate prompt reaches EOS; extend CANDIDATES")


def test_eos_stops_with_matched_token_and_ignore_eos_continues(client, eos_case):
    ids, expected = eos_case
    out = _gen(client, ids, max_new_tokens=40)
    assert out["output_ids"] == expected
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": expected[-1]}
    longer = _gen(client, ids, max_new_tokens=len(expected) + 5, ignore_eos=True)
    assert longer["output_ids"][: len(expected)] == expected
    assert longer["meta_info"]["finish_reason"] == {"type": "length", "length": len(expected) + 5}


def test_max_new_tokens_gives_length(client, tokenizer):
    out = _gen(client, tokenizer.encode("The trainer"), max_new_tokens=5, ignore_eos=True)
    assert len(out["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    zero = _gen(client, tokenizer.encode("The trainer"), max_new_tokens=0)
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_stop_token_ids_end_at_first_match(client, tokenizer, ref):
    ids = tokenizer.encode("The trainer computes a policy")
    full = ref.greedy(ids, 30)
    stop = full[4]
    k = full.index(stop)
    out = _gen(client, ids, max_new_tokens=30, stop_token_ids=[stop])
    assert out["output_ids"] == full[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_string_trims_text_and_names_the_match(client, tokenizer, ref):
    for p in CANDIDATES:  # find an output with a plain two-letter stretch to use as the stop string
        ids = tokenizer.encode(p)
        full = ref.greedy(ids, 30)
        text = tokenizer.decode(full, skip_special_tokens=True)
        i = next((i for i in range(2, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalpha()), None)
        if i is not None:
            break
    else:
        pytest.fail("no candidate output has two consecutive ASCII letters")
    stop = text[i:i + 2]
    out = _gen(client, ids, max_new_tokens=30, stop=[stop, "never-appears"])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    # Generation ends at the token that completed the stop string, not later.
    n = len(out["output_ids"])
    assert out["output_ids"] == full[:n]
    assert stop in tokenizer.decode(full[:n]) and stop not in tokenizer.decode(full[: n - 1])


def test_context_length_ends_generation(client, tokenizer, engine_url):
    ctx = client.get("/get_server_info").json()["context_length"]
    ids = tokenizer.encode("1+2=") * ((ctx - 10) // 4)
    out = _gen(client, ids, max_new_tokens=40, ignore_eos=True)
    assert len(ids) + len(out["output_ids"]) == ctx
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": ctx - len(ids)}


def test_abort_request_finishes_with_abort_and_keeps_rid(client, tokenizer, engine_url):
    import httpx

    result = {}

    def long_request():
        with httpx.Client(base_url=engine_url, timeout=120) as c:
            result["out"] = c.post("/generate", json={
                "input_ids": tokenizer.encode("1+2="), "rid": "to-abort",
                "sampling_params": {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}}).json()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while client.get("/get_load").json()["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.post("/abort_request", json={"rid": "to-abort"}).json() == {"success": True}
    t.join(60)
    meta = result["out"]["meta_info"]
    assert meta["id"] == "to-abort"
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < 500
