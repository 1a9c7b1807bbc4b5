"""Greedy decoding over real HTTP must equal transformers' generate(do_sample=False) token for token."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPTS = ["47+38=", "1+2=", "The trainer computes a policy", "999+1=", "ls cat echo grep python file",
           "Run the command, read the output, and answer", "7*8="]


def _greedy(client, ids, n):
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n}})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_matches_transformers_one_by_one(client, tokenizer, ref):
    for p in PROMPTS[:3]:
        ids = tokenizer.encode(p)
        out = _greedy(client, ids, 24)
        assert out["output_ids"] == ref.greedy(ids, 24), p
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])


def test_concurrent_requests_join_a_running_batch_and_still_match(engine_url, tokenizer, ref):
    """A long request is decoding while shorter ones with other prompt lengths join and leave."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    budgets = [64] + [12 + 3 * i for i in range(len(prompts) - 1)]
    with httpx.Client(base_url=engine_url, timeout=120) as c:
        before = c.get("/get_server_info").json()["engine_stats"]

        def post(i):
            time.sleep(0.03 * i)  # staggered, so most arrive while others are mid-decode
            return _greedy(c, prompts[i], budgets[i])

        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(post, range(len(prompts))))
        after = c.get("/get_server_info").json()["engine_stats"]

    for ids, n, out in zip(prompts, budgets, outs):
        assert out["output_ids"] == ref.greedy(ids, n), tokenizer.decode(ids)
    tokens = sum(len(o["output_ids"]) for o in outs)
    # Served one at a time, every token but each request's first would cost its own decode forward.
    assert after["decode_forwards"] - before["decode_forwards"] < tokens - len(outs)
    assert after["max_running_reqs"] >= 2


def test_batch_body_returns_one_result_per_prompt_in_order(client, tokenizer, ref):
    prompts = [tokenizer.encode(p) for p in PROMPTS[3:6]]
    r = client.post("/generate", json={"input_ids": prompts,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 16}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == len(prompts)
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == ref.greedy(ids, 16)


def test_text_prompt_equals_its_token_ids(client, tokenizer):
    a = client.post("/generate", json={"text": "47+38=", "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    b = _greedy(client, tokenizer.encode("47+38="), 8)
    assert a.status_code == 200
    assert a.json()["output_ids"] == b["output_ids"]
    assert a.json()["text"] == tokenizer.decode(b["output_ids"], skip_special_tokens=True)
