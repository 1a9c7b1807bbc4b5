"""Returned logprobs follow the documented convention and match a teacher-forced forward."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

PROMPT = "47+38="


def _gen(client, ids, **sp):
    r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "sampling_params": sp})
    assert r.status_code == 200, r.text
    out = r.json()
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    return out["output_ids"], torch.tensor([lp for lp, _, _ in lps])


def test_greedy_logprobs_match_teacher_forced(client, tokenizer, ref):
    ids = tokenizer.encode(PROMPT)
    out, lps = _gen(client, ids, temperature=0, max_new_tokens=20)
    torch.testing.assert_close(lps, ref.logprobs(ids, out, 0.0), atol=1e-4, rtol=0)


def test_sampled_logprobs_match_teacher_forced_at_temperature(client, tokenizer, ref):
    ids = tokenizer.encode("The trainer")
    out, lps = _gen(client, ids, temperature=1.0, max_new_tokens=20, sampling_seed=7)
    torch.testing.assert_close(lps, ref.logprobs(ids, out, 1.0), atol=1e-4, rtol=0)


def test_logprobs_are_taken_before_truncation(client, tokenizer, ref):
    ids = tokenizer.encode("1+2=")
    out, lps = _gen(client, ids, temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, max_new_tokens=20,
                    sampling_seed=3)
    torch.testing.assert_close(lps, ref.logprobs(ids, out, 0.7), atol=1e-4, rtol=0)


def test_same_seed_same_output_even_in_a_different_batch(engine_url, client, tokenizer):
    import httpx

    ids = tokenizer.encode(PROMPT)
    sp = {"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": 1234}
    alone, lp_alone = _gen(client, ids, **sp)
    # Same request again, this time decoded next to unrelated sampled requests.
    with httpx.Client(base_url=engine_url, timeout=120) as c, ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(_gen, c, tokenizer.encode(p), temperature=1.0, max_new_tokens=24)
                 for p in ("999+1=", "ls cat echo", "Run the command")]
        crowded, lp_crowded = _gen(c, ids, **sp)
        [f.result() for f in noise]
    assert crowded == alone
    torch.testing.assert_close(lp_crowded, lp_alone, atol=1e-5, rtol=0)
    others = {tuple(_gen(client, ids, **{**sp, "sampling_seed": s})[0]) for s in (1, 2, 3)}
    assert len(others | {tuple(alone)}) > 1, "different seeds should not all give one sequence"
