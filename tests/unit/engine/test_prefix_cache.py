"""The prefix cache reuses shared prefixes (GRPO groups, multi-turn histories) without changing outputs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from miles.engine.prefix_cache import PrefixCache


def _kv(n, fill=0.0):
    # (layers, heads, tokens, dim) filled with each token's position, so slices can be checked
    return lambda a, b: (torch.arange(a, b, dtype=torch.float32).view(1, 1, -1, 1).expand(2, 1, -1, 3) + fill,) * 2


def test_radix_tree_matches_blocks_and_evicts_least_recently_used():
    cache = PrefixCache(block_size=4, max_tokens=16)
    assert cache.insert(list(range(10)), _kv(10)) == 10  # two full blocks and a 2-token tail
    assert cache.num_tokens == 10
    hit = cache.match(list(range(9)) + [99])
    assert hit.tokens == 8  # the whole blocks; the prompt diverges inside the tail
    k, _ = PrefixCache.gather(hit)
    assert k.shape == (2, 1, 8, 3) and k[0, 0, :, 0].tolist() == list(range(8))
    assert cache.match([0, 1, 2, 3, 4, 4, 7, 7]).tokens == 4  # diverges inside the second block
    assert cache.match(list(range(10)), limit=7).tokens == 4  # never more than the limit; blocks whole
    assert cache.match(list(range(10)), limit=9).tokens == 8  # a copy of the prompt cannot take all of its tail
    hit = cache.match(list(range(12)), limit=11)
    k, _ = PrefixCache.gather(hit)
    assert hit.tokens == 10 and k[0, 0, :, 0].tolist() == list(range(10))  # a longer prompt takes it
    other = [50 + i for i in range(12)]
    assert cache.insert(other, _kv(12)) == 12
    assert cache.num_tokens <= 16  # evicted down to capacity
    assert cache.match(other).tokens == 12  # the newest entry survives
    assert cache.match(list(range(8))).tokens < 8  # the older one lost its tail first


def test_longer_tail_replaces_the_shorter_one_and_blocks_grow_past_it():
    cache = PrefixCache(block_size=4, max_tokens=100)
    assert cache.insert([1, 2, 3, 4, 5], _kv(5)) == 5
    assert cache.insert([1, 2, 3, 4, 5], _kv(5)) == 0  # nothing new
    assert cache.insert([1, 2, 3, 4], _kv(4)) == 0  # already held
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], _kv(7)) == 3  # tail 5 → tail 5 6 7, the KV recomputed once
    assert cache.num_tokens == 7
    assert cache.insert([1, 2, 3, 4, 5, 6], _kv(6)) == 2  # a tail of its own: a prompt may hold just this one
    assert cache.num_tokens == 9
    # A turn's history grows by a model turn and an observation: everything before it is reused.
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert cache.match(history, limit=len(history) - 1).tokens == 7
    assert cache.insert(history, _kv(10, fill=100.0)) == 6
    assert cache.num_tokens == 10  # both tails went into a whole block, which holds their KV
    hit = cache.match(history + [11])
    k, _ = PrefixCache.gather(hit)
    assert hit.tokens == 10 and k[0, 0, 4:, 0].tolist() == [104.0 + i for i in range(6)]
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 0]).tokens == 4  # diverges inside the block that replaced them
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 0], limit=7).tokens == 4


def test_a_finished_row_offers_whole_blocks_only_and_copies_nothing_already_held():
    cache = PrefixCache(block_size=4, max_tokens=100)
    copied = []

    def kv(a, b):
        copied.append((a, b))
        return _kv(b)(a, b)

    assert cache.insert([1, 2, 3, 4, 5, 6], kv, whole_blocks=True) == 4  # the partial block 5 6 stays out
    assert copied == [(0, 4)]
    assert cache.insert([1, 2, 3, 4, 9], kv, whole_blocks=True) == 0  # a short completion: nothing to copy
    assert copied == [(0, 4)]
    assert cache.match([1, 2, 3, 4, 5, 6, 7]).tokens == 4
    assert cache.insert([1, 2, 3, 4, 5, 6], kv) == 2  # a retracted row's prompt still keeps its tail
    assert cache.match([1, 2, 3, 4, 5, 6, 7]).tokens == 6


def test_block_size_one_caches_every_token():
    cache = PrefixCache(block_size=1, max_tokens=100)
    assert cache.insert([5, 6, 7], _kv(3)) == 3
    assert cache.match([5, 6, 8]).tokens == 2


def _gen(client, ids, n=12, logprob=True):
    r = client.post("/generate", json={"input_ids": ids, "return_logprob": logprob,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": n}})
    assert r.status_code == 200, r.text
    return r.json()


def _lps(out):
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def test_multi_turn_reuses_history_and_matches_transformers(client, tokenizer, ref, admin_token):
    client.post("/flush_cache", headers={"Authorization": f"Bearer {admin_token}"})  # other tests share prompts
    history = tokenizer.encode("The trainer computes a policy update and the engines generate under the new "
                               "weights. Run the command, read the output, and answer.")
    cached = []
    for turn in range(4):
        history = history + tokenizer.encode(f" user {turn}: 12+{turn}=")
        out = _gen(client, history)
        assert out["output_ids"] == ref.greedy(history, 12)
        torch.testing.assert_close(_lps(out), ref.logprobs(history, out["output_ids"]), atol=1e-4, rtol=0)
        cached.append(out["meta_info"]["cached_tokens"])
        history = history + out["output_ids"]
    assert cached[0] == 0
    # Every later turn reuses at least the previous turn's whole prompt, minus a partial block.
    assert all(c >= len(history) // 2 for c in cached[1:]), cached


def test_grpo_group_shares_its_prompt_and_each_sample_matches(engine_url, tokenizer, ref):
    ids = tokenizer.encode("Question 17: 345+678= Answer with the number only, then stop.")
    with httpx.Client(base_url=engine_url, timeout=120) as c, ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: _gen(c, ids, 10), range(8)))
        metrics = c.get("/metrics").text
    expected = ref.greedy(ids, 10)
    assert all(o["output_ids"] == expected for o in outs)
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    # At most the first admitted copy computes the prompt; the rest reuse (nearly) all of it.
    assert sum(c >= len(ids) - 8 for c in cached) >= 7, cached
    rate = next(float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("miles_engine_prefix_cache_hit_rate "))
    assert 0 < rate <= 1


def test_flush_cache_forgets_prefixes(client, admin_token):
    ids = list(range(100, 140))
    _gen(client, ids, 2, logprob=False)
    assert _gen(client, ids, 2, logprob=False)["meta_info"]["cached_tokens"] > 0
    client.post("/flush_cache", headers={"Authorization": f"Bearer {admin_token}"})
    assert _gen(client, ids, 2, logprob=False)["meta_info"]["cached_tokens"] == 0


def test_prompts_admitted_together_share_their_common_prefix(client, tokenizer, ref, admin_token):
    client.post("/flush_cache", headers={"Authorization": f"Bearer {admin_token}"})
    system = tokenizer.encode("System: you are a terminal agent. Tools: ls cat echo grep python. Answer briefly. ")
    prompts = [system + tokenizer.encode(q) for q in ("user: 12+30=", "user: ls file", "user: 7*8=")]
    r = client.post("/generate", json={"input_ids": prompts, "return_logprob": True,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert r.status_code == 200, r.text
    outs = r.json()
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == ref.greedy(ids, 8)
        torch.testing.assert_close(_lps(out), ref.logprobs(ids, out["output_ids"]), atol=1e-4, rtol=0)
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    block = len(system) // 8 * 8
    # One prompt paid for the shared system prompt; the other two reused it.
    assert cached[0] < block <= cached[1] <= cached[2], (cached, len(system))


def test_kv_computed_before_a_flush_never_enters_the_cache_after_it(client, admin_token):
    # A row answered before the flush but offered to the cache after it (answers go out first) must
    # not bring its prefix back: the flush is ordered against the cache's writes by its KV epoch.
    ids = list(range(200, 240))
    for _ in range(5):
        _gen(client, ids, 2, logprob=False)
        client.post("/flush_cache", headers={"Authorization": f"Bearer {admin_token}"})
        assert _gen(client, ids, 2, logprob=False)["meta_info"]["cached_tokens"] == 0
        client.post("/flush_cache", headers={"Authorization": f"Bearer {admin_token}"})
