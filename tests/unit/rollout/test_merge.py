"""Merged requests (rollout/merge.py) against a real engine server: a step's groups reach the engine in
one POST and one prefill, each group gets its own samples, and one group's bad request or timeout
touches no other group."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from miles.engine_api.client import EngineClient
from miles.rollout.config import RolloutConfig
from miles.rollout.generate import GenerationError
from miles.rollout.group import GroupGenerator


def _generator(url: str, merge: bool = True, n: int = 4) -> GroupGenerator:
    cfg = RolloutConfig(n_samples_per_prompt=n, max_new_tokens=4, merge_requests=merge)
    return GroupGenerator(cfg, seed=3, tokenizer=None, rewards=None, generate_fn=None,
                          buffer=SimpleNamespace(weight_version=0), admin=EngineClient([url]), stopping=threading.Event())


def _prompt(i: int):
    return SimpleNamespace(index=i, label=str(i), metadata={}, images=())


def _groups(gen: GroupGenerator, url: str, prompts: dict[int, list[int]]) -> list:
    """Every prompt's samples, generated together as a step's groups are; an exception in place of a
    group that failed."""
    async def run():
        async with EngineClient.async_http(60.0) as client:
            return await asyncio.gather(*(gen._generate_samples(client, url, ids, _prompt(i), [])
                                          for i, ids in prompts.items()), return_exceptions=True)
    return asyncio.run(run())


def test_a_steps_groups_share_one_post_and_one_prefill_and_get_the_samples_they_would_alone(engine_thread):
    url, stats = engine_thread.url, engine_thread.engine.stats
    prompts = {i: [5 + i, 9, 11 + i, 7] for i in range(6)}
    before = stats["prefill_forwards"]
    merged_gen = _generator(url)
    merged = _groups(merged_gen, url, prompts)
    assert merged_gen.merger.posts == 1
    assert stats["prefill_forwards"] - before == 1
    alone = _groups(_generator(url, merge=False), url, prompts)
    for i, (m, a) in enumerate(zip(merged, alone)):
        # Seeded per sample: batching does not change what a sample draws.
        assert [s.response_ids for s in m] == [s.response_ids for s in a]
        assert [s.prompt_ids for s in m] == [prompts[i]] * 4
        assert {(s.prompt_index, s.label) for s in m} == {(i, str(i))}
        assert [x for s in m for x in s.rollout_logprobs] == pytest.approx([x for s in a for x in s.rollout_logprobs], abs=1e-5)


def test_a_request_the_engine_refuses_fails_its_group_alone(engine_thread):
    url = engine_thread.url
    gen = _generator(url)
    bad = [5, 10**7]  # outside the vocabulary: the engine refuses the whole POST (400)
    out = _groups(gen, url, {0: [5, 6, 7], 1: bad, 2: [8, 9]})
    assert isinstance(out[1], GenerationError) and "outside the vocabulary" in str(out[1])
    assert [len(g) for g in (out[0], out[2])] == [4, 4]
    assert all(s.response_ids for g in (out[0], out[2]) for s in g)
    assert gen.merger.posts == 4  # the merged POST, then each part alone


def test_a_group_that_stops_waiting_leaves_the_others_their_samples(engine_thread):
    url = engine_thread.url
    gen = _generator(url)

    async def run():
        async with EngineClient.async_http(60.0) as client:
            def one(i):
                return gen.merger.generate(client, url, [[5, 6, i]] * 4, [gen.sampling_params(i, k) for k in range(4)],
                                           [f"t{i}-{k}" for k in range(4)], None, i)
            timed_out = asyncio.wait_for(one(0), timeout=1e-4)
            return await asyncio.gather(timed_out, one(1), one(2), return_exceptions=True)

    out = asyncio.run(run())
    assert isinstance(out[0], asyncio.TimeoutError)
    assert [len(g) for g in out[1:]] == [4, 4] and gen.merger.posts == 1
