"""The reward runner: a raising and a hanging reward are counted (reward/errors, reward/timeouts),
their samples get the fallback (or their group is dropped) and scoring goes on; past
max_error_rate the run stops with the reward's own traceback and the offending sample; sync
rewards run in a process pool with num_workers, where a hung worker is replaced and a killed one
is replaced with its call made again."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from miles.buffer.types import Sample
from miles.rewards.config import RewardConfig
from miles.rewards.runner import RewardError, RewardRunner

FLAKY = '''
import asyncio, os, time

def flaky(response, label):
    if response == "boom":
        raise ZeroDivisionError("the reward's own bug")
    if response == "hang":
        time.sleep(3)
    if response == "stall":  # only in a pool worker, which the runner kills at the timeout
        time.sleep(60)
    return 1.0

async def flaky_async(sample):
    if sample.response == "hang":
        await asyncio.sleep(30)
    if sample.response == "boom":
        raise KeyError("missing")
    return 1.0

def pid(response, label):
    return float(os.getpid())

def slow_pid(response, label):
    time.sleep(1.5)
    return float(os.getpid())

def bad_type(response, label):
    return "yes"

def shaped(response, label):
    right = response == label
    return {"score": 1.0 if right else 0.1, "correct": right}

def bad_correct(response, label):
    return {"score": 1.0, "correct": "yes"}
'''


@pytest.fixture()
def flaky_file(tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text(textwrap.dedent(FLAKY))
    return path


def _samples(texts):
    return [Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], loss_mask=[1], response_text=t,
                   label="x") for t in texts]


@pytest.mark.parametrize("fn", ["flaky", "flaky_async"])
def test_raising_and_hanging_rewards_are_counted_and_get_the_fallback(flaky_file, fn):
    runner = RewardRunner(f"{flaky_file}:{fn}", RewardConfig(timeout_s=0.3, fallback_score=-1.0, max_error_rate=1.0))
    samples = _samples(["ok", "boom", "hang", "ok"])
    assert asyncio.run(runner.score_group(samples))
    assert [s.reward for s in samples] == [1.0, -1.0, -1.0, 1.0]
    m = runner.take_metrics()
    assert (m["reward/calls"], m["reward/errors"], m["reward/timeouts"]) == (4, 1, 1)
    more = _samples(["ok", "ok"])  # scoring goes on
    assert asyncio.run(runner.score_group(more)) and [s.reward for s in more] == [1.0, 1.0]
    assert runner.take_metrics()["reward/errors"] == 0
    runner.close()


def test_drop_group_on_error(flaky_file):
    runner = RewardRunner(f"{flaky_file}:flaky", RewardConfig(on_error="drop_group", max_error_rate=1.0))
    assert not asyncio.run(runner.score_group(_samples(["ok", "boom"])))
    assert asyncio.run(runner.score_group(_samples(["ok", "ok"])))
    runner.close()


def test_group_dropped_by_a_reward_goes_to_the_buffer_as_reward_error():
    from miles.buffer.data_buffer import BufferConfig, DataBuffer
    from miles.buffer.types import Group, Reason, Verdict
    from miles.data.prompts import PromptSource, TaskConfig

    buf = DataBuffer(BufferConfig(on_failure="drop"), PromptSource(TaskConfig(), "train", 0))
    p = buf.draw(1)[0]
    assert buf.put(Group(samples=[], prompt_index=p.index, failure=Reason.REWARD_ERROR)) == \
        (Verdict.DISCARDED, Reason.REWARD_ERROR)


def test_error_rate_past_the_threshold_stops_with_the_traceback_and_sample(flaky_file):
    runner = RewardRunner(f"{flaky_file}:flaky", RewardConfig(max_error_rate=0.25, min_calls=4))
    assert asyncio.run(runner.score_group(_samples(["ok", "ok", "ok", "boom"])))  # 1 of 4: under the threshold
    with pytest.raises(RewardError) as e:
        asyncio.run(runner.score_group(_samples(["boom"])))
    text = str(e.value)
    assert "2 of 5 calls" in text and "max_error_rate = 0.25" in text
    assert "ZeroDivisionError: the reward's own bug" in text and 'raise ZeroDivisionError' in text  # its traceback
    assert "response='boom'" in text and "label='x'" in text  # the offending sample
    runner.close()


def test_a_wrong_return_type_is_an_error_naming_the_contract(flaky_file):
    runner = RewardRunner(f"{flaky_file}:bad_type", RewardConfig(max_error_rate=0.0, min_calls=1))
    with pytest.raises(RewardError, match="returned str; return a float or a dict with 'score'"):
        asyncio.run(runner.score_group(_samples(["ok"])))
    runner.close()


def test_process_pool_runs_sync_rewards_in_workers_and_replaces_a_hung_one(flaky_file):
    import os

    runner = RewardRunner(f"{flaky_file}:pid", RewardConfig(num_workers=2))
    samples = _samples(["a", "b", "c"])
    asyncio.run(runner.score_group(samples))
    assert all(s.reward not in (0.0, float(os.getpid())) for s in samples)
    runner.close()

    # The timeout also covers the fresh worker's start (a new process importing the reward) for the
    # next group, so it leaves room for a slow machine; the stalled call would run a minute.
    runner = RewardRunner(f"{flaky_file}:flaky", RewardConfig(num_workers=1, timeout_s=5.0, max_error_rate=1.0))
    samples = _samples(["stall"])
    asyncio.run(runner.score_group(samples))
    assert runner.take_metrics()["reward/timeouts"] == 1
    samples = _samples(["ok", "boom"])  # a fresh worker scores the next group; an error keeps its traceback
    asyncio.run(runner.score_group(samples))
    assert [s.reward for s in samples] == [1.0, 0.0] and runner.take_metrics()["reward/errors"] == 1
    runner.close()


def test_a_killed_pool_worker_is_replaced_and_its_call_made_again(flaky_file):
    import os
    import signal
    import threading
    import time

    runner = RewardRunner(f"{flaky_file}:slow_pid", RewardConfig(num_workers=1, timeout_s=30))
    first = _samples(["a"])
    asyncio.run(runner.score_group(first))
    (worker,) = runner.worker_pids()
    assert first[0].reward == float(worker)
    runner.take_metrics()

    samples = _samples(["b", "c"])
    scoring = threading.Thread(target=lambda: asyncio.run(runner.score_group(samples)))
    scoring.start()
    time.sleep(0.5)  # the worker is inside the call
    os.kill(worker, signal.SIGKILL)
    scoring.join(60)
    assert not scoring.is_alive()
    (replacement,) = runner.worker_pids()
    assert replacement != worker
    assert [s.reward for s in samples] == [float(replacement)] * 2  # real scores, not the fallback
    m = runner.take_metrics()
    assert (m["reward/calls"], m["reward/errors"], m["reward/worker_restarts"]) == (2, 0, 1)
    runner.close()


def test_an_inline_reward_runs_on_the_event_loop_and_its_errors_are_counted_like_any_other():
    import threading

    from miles.rewards.contract import check_reward, reward

    where: list[str] = []

    @reward(inline=True)
    def cheap(response, label):
        where.append(threading.current_thread().name)
        if response == "boom":
            raise ValueError("bad")
        return float(response == label)

    def threaded(response, label):
        where.append(threading.current_thread().name)
        return 1.0

    runner = RewardRunner("exact_match", RewardConfig(fallback_score=-1.0, max_error_rate=1.0))
    runner.components = [(check_reward("cheap", cheap), 1.0)]

    async def score(samples):
        loop_thread = threading.current_thread().name
        return loop_thread, await runner.score_group(samples)

    samples = _samples(["x", "y", "boom"])
    loop_thread, kept = asyncio.run(score(samples))
    assert kept and [s.reward for s in samples] == [1.0, 0.0, -1.0]
    assert where == [loop_thread] * 3
    m = runner.take_metrics()
    assert (m["reward/calls"], m["reward/errors"]) == (3, 1)
    where.clear()
    runner.components = [(check_reward("threaded", threaded), 1.0)]
    asyncio.run(score(_samples(["x"])))
    assert where[0].startswith("reward")  # a plain def without inline still gets a thread
    runner.close()


def test_the_cheap_builtins_are_inline_and_an_async_reward_cannot_be():
    from miles.registry import RegistryError
    from miles.rewards.contract import check_reward, load_reward, reward

    assert load_reward("exact_match").inline and load_reward("boxed_format").inline
    assert not load_reward("math").inline  # math-verify may take long: a thread, under the timeout

    @reward(inline=True)
    async def bad(response, label):
        return 1.0

    with pytest.raises(RegistryError, match="inline but is `async def`"):
        check_reward("bad", bad)


def test_a_reward_says_which_samples_are_right(flaky_file):
    # A shaped reward: a wrong answer earns 0.1 but is not right.
    runner = RewardRunner(f"{flaky_file}:shaped")
    samples = _samples(["x", "y"])
    asyncio.run(runner.score_group(samples))
    assert [(s.reward, s.correct) for s in samples] == [(1.0, True), (0.1, False)]
    assert runner.take_metrics()["reward/correct"] == 0.5
    # A built-in says it too; a reward returning a bare float does not (eval falls back to score > 0).
    builtin, plain = RewardRunner("exact_match"), RewardRunner(f"{flaky_file}:flaky")
    asyncio.run(builtin.score_group(samples))
    assert [s.correct for s in samples] == [True, False]
    asyncio.run(plain.score_group(samples))
    assert [s.correct for s in samples] == [None, None]
    # A verdict that is not True/False is the reward's bug, counted as one; a failed call is never right.
    bad = RewardRunner(f"{flaky_file}:bad_correct", RewardConfig(max_error_rate=1.0))
    asyncio.run(bad.score_group(samples))
    assert [s.correct for s in samples] == [False, False] and bad.take_metrics()["reward/errors"] == 2
    for r in (runner, builtin, plain, bad):
        r.close()
