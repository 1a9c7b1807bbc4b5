"""Per-group generation's pure parts: seeded sampling parameters, long-tail lengths and statistics."""

from __future__ import annotations

import threading

from miles.buffer.types import Group, Sample, SampleStatus
from miles.rollout.config import RolloutConfig
from miles.engine_api.client import EngineClient
from miles.rollout.group import GroupGenerator, long_tail_length
from miles.rollout.stats import SampleStats


def _generator(**cfg) -> GroupGenerator:
    return GroupGenerator(RolloutConfig(**cfg), seed=3, tokenizer=None, rewards=None, generate_fn=None, buffer=None,
                          admin=EngineClient(["http://127.0.0.1:1"]), stopping=threading.Event())


def test_each_sample_has_its_own_reproducible_seed():
    a, b = _generator(), _generator()
    seeds = {a.sampling_params(p, k).seed for p in range(4) for k in range(4)}
    assert len(seeds) == 16
    assert a.sampling_params(2, 1) == b.sampling_params(2, 1)
    assert _generator().sampling_params(0, 0).max_new_tokens == RolloutConfig().max_new_tokens


def test_long_tail_lengths_are_bounded_fixed_by_key_and_ignore_eos():
    lengths = [long_tail_length(256, key) for key in range(500)]
    assert all(16 <= n <= 256 for n in lengths)
    assert lengths == [long_tail_length(256, key) for key in range(500)]
    assert sorted(lengths)[250] < 64 < max(lengths)  # most short, a few long
    p = _generator(response_lengths="long_tail", max_new_tokens=256).sampling_params(0, 0)
    assert p.ignore_eos and p.max_new_tokens <= 256


def test_stats_report_per_sample_and_per_group_figures():
    def sample(reward, n, status=SampleStatus.COMPLETED):
        return Sample(prompt_ids=[1], response_ids=[2] * n, rollout_logprobs=[0.0] * n, loss_mask=[1] * n, status=status,
                      reward=reward)

    stats = SampleStats()
    stats.add(Group(samples=[sample(1.0, 4), sample(0.0, 2, SampleStatus.TRUNCATED)]), seconds=2.0)
    stats.add(Group(samples=[sample(1.0, 3), sample(1.0, 3)]), seconds=5.0)
    m = stats.metrics(elapsed=4.0)
    assert m["rollout/samples"] == 4 and m["rollout/reward_mean"] == 0.75
    assert m["rollout/response_len_mean"] == 3 and m["rollout/truncated_frac"] == 0.25
    assert m["rollout/zero_std_group_frac"] == 0.5 and m["rollout/group_time_max_s"] == 5.0
    assert m["rollout/tokens_per_s"] == 3.0


def test_reward_seconds_are_wall_time_while_any_group_is_scored():
    import asyncio
    import time

    stats = SampleStats()

    async def score(delay):
        await asyncio.sleep(delay)
        with stats.scoring():
            await asyncio.sleep(0.2)

    async def main():
        await asyncio.gather(*(score(0.0) for _ in range(8)), score(0.3))

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    # Eight groups scored at once count 0.2 s, not 1.6 s; the late one adds its own 0.2 s (a sum of
    # per-group latencies would give 1.8 s).
    reward_s = stats.metrics(elapsed=1.0)["perf/reward_s"]
    assert 0.38 <= reward_s <= wall and reward_s < 1.0


def test_a_sample_from_an_engine_behind_the_version_the_fleet_was_known_to_hold_is_off_fleet():
    """rollout/off_fleet_samples counts these: the fleet was known to hold `known` (committed by every
    engine) when the request went out, and the engine answered at an older version (3)."""
    import asyncio
    from types import SimpleNamespace

    from tests.helpers.scripted_engine import ScriptedEngine

    engine = ScriptedEngine()  # answers at weight version 3
    prompt = SimpleNamespace(index=0, label=None, metadata={}, images=())
    try:
        for known, off in ((2, False), (3, False), (4, True)):
            engine.replies = [[5, 6], [7, 8]]
            gen = GroupGenerator(RolloutConfig(n_samples_per_prompt=2, batch_requests=False, max_new_tokens=2),
                                 seed=3, tokenizer=None, rewards=None, generate_fn=None,
                                 buffer=SimpleNamespace(weight_version=known), admin=EngineClient([engine.url]),
                                 stopping=threading.Event())

            async def generate():
                async with EngineClient.async_http(30.0) as client:
                    return await gen._generate_samples(client, engine.url, [1, 2], prompt, [])

            samples = asyncio.run(generate())
            assert [s.off_fleet for s in samples] == [off, off], known
            assert [s.weight_versions for s in samples] == [[min(known, 3)]] * 2
    finally:
        engine.http.stop()
