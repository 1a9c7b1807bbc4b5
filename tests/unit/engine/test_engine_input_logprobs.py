"""Prompt-token logprobs as SGLang returns them (`return_logprob` + `logprob_start_len` ->
`meta_info.input_token_logprobs`): equal to a plain forward's log-softmax, with the prefix cache on
(cached prefixes still scored) and off, and `max_new_tokens: 0` scoring without generating."""

from __future__ import annotations

import httpx
import pytest
import torch

from miles.engine.config import EngineConfig
from miles.engine.server import start_server_thread

PROMPTS = ["47+38=", "The trainer computes a policy update from samples", "ls cat echo grep python file 7*8="]


@pytest.fixture(scope="module", params=[True, False], ids=["prefix_cache", "no_prefix_cache"])
def server(request, model_dir):
    srv = start_server_thread(EngineConfig(model_path=model_dir, prefix_cache=request.param, prefix_block_size=2))
    yield srv
    srv.stop()


def plain_logprobs(hf_model, ids: list[int]) -> list[float]:
    """log_softmax of an untempered forward, gathered on tokens 1..n-1 of `ids`."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()  # (n-1, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def score(url, prompts, start, **sp):
    body = {"input_ids": prompts, "return_logprob": True, "logprob_start_len": start,
            "sampling_params": {"max_new_tokens": 0, **sp}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_input_logprobs_equal_a_plain_forward_for_a_batch_of_lengths(server, tokenizer, hf_model):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3
    # Twice: the second time the engine with a prefix cache holds every prompt's KV, and must still score.
    for _ in range(2):
        out = score(server.url, prompts, 0)
        for ids, o in zip(prompts, out):
            triples = o["meta_info"]["input_token_logprobs"]
            assert [t for _, t, _ in triples] == ids and all(text is None for _, _, text in triples)
            assert triples[0][0] is None  # nothing predicts the first prompt token
            torch.testing.assert_close(torch.tensor([lp for lp, _, _ in triples[1:]]),
                                       torch.tensor(plain_logprobs(hf_model, ids)), atol=2e-5, rtol=0)
            # Scoring only: no token generated, none sampled.
            assert o["output_ids"] == [] and o["meta_info"]["output_token_logprobs"] == []
            assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_logprob_start_len_k_scores_from_position_k_and_minus_one_scores_none(server, tokenizer, hf_model):
    ids = tokenizer.encode(PROMPTS[1])
    full = plain_logprobs(hf_model, ids)
    for k in (3, len(ids) - 1):
        triples = score(server.url, [ids], k)[0]["meta_info"]["input_token_logprobs"]
        # SGLang's shape: tokens k.. of the prompt, the first of them without a logprob.
        assert [t for _, t, _ in triples] == ids[k:] and triples[0][0] is None
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in triples[1:]]),
                                   torch.tensor(full[k:]), atol=2e-5, rtol=0)
    assert score(server.url, [ids], len(ids))[0]["meta_info"]["input_token_logprobs"] == []
    # -1: only the output tokens are scored; a request that also generates still gets both lists.
    out = score(server.url, [ids], -1, max_new_tokens=3, temperature=0)[0]
    assert out["meta_info"]["input_token_logprobs"] == [] and len(out["meta_info"]["output_token_logprobs"]) == 3
    both = score(server.url, [ids], 0, max_new_tokens=3, temperature=0)[0]
    assert both["output_ids"] == out["output_ids"] and len(both["meta_info"]["input_token_logprobs"]) == len(ids)


def test_a_start_past_the_prompt_is_refused_naming_the_field(server, tokenizer):
    ids = tokenizer.encode(PROMPTS[0])
    r = httpx.post(server.url + "/generate", json={"input_ids": ids, "return_logprob": True,
                                                   "logprob_start_len": len(ids) + 1}, timeout=60)
    assert r.status_code == 400 and "logprob_start_len" in r.text
