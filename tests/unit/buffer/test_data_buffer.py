"""DataBuffer rules: arrival checks, staleness on the way out, backpressure, in-flight bounds,
pacing, retries, checkpoints; the ledger balances through all of them."""

import threading
import time

import pytest

from miles.buffer.data_buffer import BufferConfig, DataBuffer
from miles.buffer.ledger import LedgerError
from miles.buffer.types import Group, Reason, Sample, Verdict
from miles.data.prompts import Prompt, PromptSource, TaskConfig


def make_buffer(**over) -> DataBuffer:
    return DataBuffer(BufferConfig(**over), PromptSource(TaskConfig(), "train", seed=0))


def group_for(prompt, rewards=(0.0, 1.0), versions=(0,), failure=None, length=3) -> Group:
    samples = [Sample(prompt_ids=[1, 2], response_ids=[5] * length, rollout_logprobs=[-0.1] * length,
                      loss_mask=[1] * length, reward=r, weight_versions=list(versions), prompt_index=prompt.index)
               for r in rewards]
    return Group(samples=[] if failure else samples, prompt_index=prompt.index, failure=failure)


def test_group_with_signal_is_trained_and_all_equal_rewards_are_discarded():
    buf = make_buffer()
    good, flat = buf.draw(2)
    assert buf.put(group_for(good)) == (None, None)
    assert buf.put(group_for(flat, rewards=(1.0, 1.0))) == (Verdict.DISCARDED, Reason.FILTERED)
    assert [g.prompt_index for g in buf.get()] == [good.index]
    m = buf.metrics()
    assert m["buffer/trained"] == 1 and m["buffer/discarded_filtered"] == 1 and m["buffer/drawn"] == 2
    assert buf.ledger.check()["pending"] == 0


def test_custom_filter_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_filters.py").write_text("def long_enough(group):\n"
                                            "    return all(len(s.response_ids) >= 4 for s in group.samples)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    buf = make_buffer(filter="my_filters:long_enough")
    short, long_ = buf.draw(2)
    assert buf.put(group_for(short, rewards=(0.0, 1.0), length=2))[1] is Reason.FILTERED
    assert buf.put(group_for(long_, rewards=(1.0, 1.0), length=5)) == (None, None)  # equal rewards pass here


def test_bad_filter_names_the_fix():
    from miles.config import ConfigError

    with pytest.raises(ConfigError, match="choose one of"):
        BufferConfig(filter="no_such_filter").validate()
    with pytest.raises(ConfigError, match="cannot be loaded"):
        BufferConfig(filter="miles.buffer.filters:missing").validate()


def test_failed_group_is_retried_first_then_discarded_when_retries_run_out():
    buf = make_buffer(max_retries=1)
    (p,) = buf.draw(1)
    assert buf.put(group_for(p, failure=Reason.TIMEOUT)) == (Verdict.RETRIED, Reason.TIMEOUT)
    (again,) = buf.draw(1)
    assert again.index == p.index  # the retry goes before fresh prompts
    assert buf.put(group_for(again, failure=Reason.ABORTED)) == (Verdict.DISCARDED, Reason.ABORTED)
    (fresh,) = buf.draw(1)
    assert fresh.index != p.index
    m = buf.metrics()
    assert m["buffer/retried_timeout"] == 1 and m["buffer/discarded_aborted"] == 1


def test_failed_group_is_dropped_when_configured():
    buf = make_buffer(on_failure="drop")
    (p,) = buf.draw(1)
    assert buf.put(group_for(p, failure=Reason.ENGINE_FAILURE)) == (Verdict.DISCARDED, Reason.ENGINE_FAILURE)
    assert buf.ledger.check()["discarded"] == 1


def test_fresh_at_put_but_stale_at_get_is_caught():
    buf = make_buffer(max_staleness=2)
    (p,) = buf.draw(1)
    assert buf.put(group_for(p, versions=(0,))) == (None, None)  # fresh on arrival
    buf.set_policy_version(3)  # the trainer moved on while the group waited
    assert buf.get() == []
    m = buf.metrics()
    assert m["buffer/discarded_stale"] == 1 and m["buffer/dropped_stale"] == 1 and m["buffer/trained"] == 0


def test_group_at_the_staleness_limit_is_trained_and_its_staleness_reported():
    buf = make_buffer(max_staleness=2)
    (p,) = buf.draw(1)
    buf.put(group_for(p, versions=(1,)))
    buf.set_policy_version(3)
    assert len(buf.get()) == 1
    assert buf.metrics()["buffer/staleness_mean"] == 2


def test_stale_group_can_be_retried():
    buf = make_buffer(max_staleness=0, on_stale="retry")
    (p,) = buf.draw(1)
    buf.put(group_for(p))
    buf.set_policy_version(1)
    assert buf.get() == []
    assert buf.draw(1)[0].index == p.index
    assert buf.metrics()["buffer/retried_stale"] == 1


def test_group_that_arrives_stale_is_handled_at_put():
    # Its turns spanned updates: the first turn ran under version 0, the last under version 4.
    buf = make_buffer(max_staleness=2)
    (p,) = buf.draw(1)
    buf.set_policy_version(4)
    assert buf.put(group_for(p, versions=(0, 4))) == (Verdict.DISCARDED, Reason.STALE)


def test_full_buffer_blocks_the_producer_until_the_trainer_collects():
    buf = make_buffer(capacity=1)
    a, b = buf.draw(2)
    buf.put(group_for(a))
    done = threading.Event()
    threading.Thread(target=lambda: (buf.put(group_for(b)), done.set()), daemon=True).start()
    assert not done.wait(0.3)  # backpressure: nothing is dropped, the producer waits
    assert [g.prompt_index for g in buf.get(1)] == [a.index]
    assert done.wait(5)
    assert [g.prompt_index for g in buf.get(1, timeout=5)] == [b.index]


def test_in_flight_groups_are_bounded():
    buf = make_buffer(max_inflight_groups=2)
    first, _ = buf.admit(), buf.admit()
    assert buf.admit(timeout=0.1) is None
    buf.put(group_for(first))
    assert buf.admit(timeout=1) is not None


def test_pacing_stops_admission_while_the_oldest_in_flight_group_is_at_the_limit():
    for pacing, admitted in ((True, False), (False, True)):
        buf = make_buffer(max_staleness=1, pacing=pacing)
        slow = buf.admit()  # started under weight version 0
        buf.set_policy_version(1)
        assert (buf.admit(timeout=0.1) is not None) is admitted
        if pacing:
            buf.put(group_for(slow, versions=(0,)))  # the long rollout lands; admission resumes
            assert buf.admit(timeout=1) is not None


def test_get_times_out_with_a_message_naming_what_is_stuck():
    buf = make_buffer()
    buf.admit()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="1 in flight"):
        buf.get(1, timeout=0.2)
    assert time.monotonic() - t0 < 2


def test_put_of_a_group_never_handed_out_is_refused():
    buf = make_buffer()
    with pytest.raises(ValueError, match="not in flight"):
        buf.put(group_for(Prompt(index=99, text="x", label="y")))


def test_state_dict_keeps_ready_groups_and_turns_in_flight_into_retries():
    buf = make_buffer()
    ready, flying = buf.draw(2)
    buf.put(group_for(ready, versions=(0, 1)))
    buf.set_policy_version(1)
    state = buf.state_dict()

    restored = make_buffer()
    restored.load_state_dict(state, Prompt)
    assert restored.ledger.check() == {"drawn": 2, "trained": 0, "discarded": 0, "in_flight": 0,
                                       "buffered": 1, "retry_pending": 1, "pending": 2}
    (g,) = restored.get()
    assert g.prompt_index == ready.index and g.samples[0].weight_versions == [0, 1]
    assert restored.draw(1)[0] == flying


def test_ledger_refuses_to_count_a_prompt_twice():
    buf = make_buffer()
    (p,) = buf.draw(1)
    buf.put(group_for(p))
    buf.get()
    with pytest.raises(LedgerError):
        buf.ledger.trained(p.index, 2)


def test_in_flight_prompts_are_regenerated_first_after_a_resume_without_spending_a_retry():
    buf = make_buffer(max_retries=1)
    failed, ready, flying_a, flying_b = buf.draw(4)
    buf.put(group_for(failed, failure=Reason.TIMEOUT))  # in the retry queue, its one retry spent
    buf.put(group_for(ready))
    state = buf.state_dict()
    assert [p["index"] for p in state["in_flight"]] == [flying_a.index, flying_b.index]
    assert [p["index"] for p in state["retry"]] == [failed.index]

    restored = make_buffer(max_retries=1)
    restored.load_state_dict(state, Prompt)
    restored.source.load_state_dict(state["source"])
    # The rest of the batch that was being generated, in its order, and nothing else.
    assert restored.draw_resumed() == [flying_a, flying_b]
    assert restored.draw_resumed() == []
    assert [p.index for p in restored.draw(2)] == [failed.index, 4]
    # A regenerated prompt still has all of its retries: the checkpoint was not its failure.
    assert restored.put(group_for(flying_a, failure=Reason.TIMEOUT)) == (Verdict.RETRIED, Reason.TIMEOUT)


def test_fully_async_admission_takes_the_resumed_prompts_before_retries_and_fresh_ones():
    buf = make_buffer()
    failed, flying = buf.draw(2)
    buf.put(group_for(failed, failure=Reason.ABORTED))
    restored, state = make_buffer(), buf.state_dict()
    restored.load_state_dict(state, Prompt)
    restored.source.load_state_dict(state["source"])
    assert [restored.admit(timeout=1).index for _ in range(3)] == [flying.index, failed.index, 2]
    assert restored.ledger.check()["in_flight"] == 3


def test_the_ledger_records_the_step_that_trained_each_prompt_and_keeps_it_across_a_checkpoint():
    buf = make_buffer()
    first, second = buf.draw(2)
    buf.put(group_for(first))
    buf.get()
    buf.set_policy_version(1)
    buf.put(group_for(second, versions=(1,)))
    restored = make_buffer()
    restored.load_state_dict(buf.state_dict(), Prompt)
    restored.get()
    assert restored.ledger.trained_at == {first.index: 1, second.index: 2}


def test_images_of_samples_and_prompts_survive_a_checkpoint_as_json():
    import dataclasses
    import json

    from miles.buffer.types import PromptImage

    image = PromptImage.of(b"\x89PNG pretend bytes")
    buf = make_buffer()
    ready, _ = buf.draw(2)
    group = group_for(ready)
    for s in group.samples:
        s.images = (image,)
    buf.put(group)
    state = json.loads(json.dumps(buf.state_dict()))  # a checkpoint's rollout.json holds it as JSON
    restored = make_buffer()
    restored.load_state_dict(state, Prompt)
    (g,) = restored.get()
    assert [s.images for s in g.samples] == [(image,), (image,)] and g.samples[0].images[0].bytes() == image.bytes()
    prompt = Prompt(index=3, text="How many dots?", label="2", images=(image,))
    assert Prompt(**json.loads(json.dumps(dataclasses.asdict(prompt)))).images == (image,)
