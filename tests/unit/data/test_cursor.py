"""The data cursor: seeded per-epoch shuffles, epochs, and a checkpointed (epoch, position) so a
resumed run draws exactly the prompts an uninterrupted run would have drawn, across epoch boundaries."""

from __future__ import annotations

import json

import pytest

from miles.data.config import DataConfig
from miles.data.cursor import DataCursor, DataExhausted
from miles.rollout.config import RolloutConfig
from miles.data.prompts import TaskConfig


def test_each_epoch_is_a_fresh_permutation_fixed_by_the_seed():
    c = DataCursor(10, seed=4, shuffle=True)
    first, second = [c.next() for _ in range(10)], [c.next() for _ in range(10)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    again = DataCursor(10, seed=4, shuffle=True)
    assert [again.next() for _ in range(20)] == first + second
    plain = DataCursor(3, seed=4, shuffle=False)
    assert [plain.next() for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_num_epochs_bounds_the_draws():
    c = DataCursor(3, seed=0, shuffle=True, num_epochs=2)
    [c.next() for _ in range(6)]
    with pytest.raises(DataExhausted, match="num_epochs"):
        c.next()


@pytest.mark.parametrize("n, m", [(3, 4), (7, 6), (10, 10)])
def test_cursor_restore_draws_what_an_uninterrupted_cursor_draws(n, m):
    whole = DataCursor(5, seed=1, shuffle=True)
    expected = [whole.next() for _ in range(n + m)]
    a = DataCursor(5, seed=1, shuffle=True)
    drawn = [a.next() for _ in range(n)]
    b = DataCursor(5, seed=1, shuffle=True)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert drawn + [b.next() for _ in range(m)] == expected


def test_restore_refuses_another_dataset_or_seed():
    state = DataCursor(5, seed=1, shuffle=True).state_dict()
    with pytest.raises(ValueError, match="resume with the run's own data"):
        DataCursor(6, seed=1, shuffle=True).load_state_dict(state)


def test_resumed_manager_neither_repeats_nor_skips_a_prompt(tmp_path, tiny_model_dir):
    """Through the rollout manager's checkpoint (buffer_state_dict, as context.save_state writes it):
    draw N, save, restore into a fresh manager, draw M == draws N..N+M of an uninterrupted run, across
    an epoch boundary; prompts in flight at the save come back first, as retries."""
    from miles.rollout.manager import RolloutManager

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "label": str(i), "metadata": {"i": i}}
            for i in range(6)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = TaskConfig(name="dataset", data=DataConfig(path=str(path), layout="slime", prompt_key="prompt",
                                                      eval_fraction=0))

    def manager():
        return RolloutManager(RolloutConfig(task=task), tiny_model_dir, ["http://127.0.0.1:1"], seed=5)

    n, m = 4, 7
    whole = manager().buffer.draw(n + m)
    a = manager()
    first = a.buffer.draw(n)
    state = json.loads(json.dumps(a.buffer_state_dict()))  # as rollout.json holds it
    assert state["source"]["task"] == {"epoch": 0, "position": n, "seed": 5, "shuffle": True, "num_rows": 6}
    b = manager()
    b.load_buffer_state_dict(state)
    resumed = b.buffer.draw(n + m)
    assert sorted(p.index for p in resumed[:n]) == [p.index for p in first]  # in flight: retried
    assert resumed[:n] and {p.text for p in resumed[:n]} == {p.text for p in first}
    assert [(p.index, p.text, p.label, p.messages, p.metadata) for p in resumed[n:]] == \
        [(p.index, p.text, p.label, p.messages, p.metadata) for p in whole[n:]]
    assert b.buffer.source.task.cursor.epoch == 1  # 11 draws of 6 rows crossed into the second epoch


def test_sources_without_a_cursor_resume_by_replay_and_old_checkpoints_load(tiny_model_dir):
    """arithmetic has no state of its own: the saved position is replayed; a checkpoint written
    before the source state existed (no "source" key) resumes after the ledger's last prompt."""
    from miles.rollout.manager import RolloutManager

    def manager():
        return RolloutManager(RolloutConfig(), tiny_model_dir, ["http://127.0.0.1:1"], seed=2)

    whole = manager().buffer.draw(8)
    a = manager()
    a.buffer.draw(5)
    state = json.loads(json.dumps(a.buffer_state_dict()))
    assert state["source"] == {"position": 5, "task": None}
    for saved in (state, {k: v for k, v in state.items() if k != "source"}):
        b = manager()
        b.load_buffer_state_dict(saved)
        assert [p.text for p in b.buffer.draw(8)[5:]] == [p.text for p in whole[5:]]


def test_a_manager_goes_back_to_an_earlier_checkpoint_in_place(tiny_model_dir):
    """A trainer restart (fault.restart_trainer) loads an older checkpoint into the running manager,
    whose source has drawn past it: the draws after the load are those after the checkpoint."""
    from miles.rollout.manager import RolloutManager

    def manager():
        return RolloutManager(RolloutConfig(), tiny_model_dir, ["http://127.0.0.1:1"], seed=2)

    whole = manager().buffer.draw(8)
    live = manager()
    live.buffer.draw(3)
    saved = json.loads(json.dumps(live.buffer_state_dict()))
    live.buffer.draw(4)
    live.load_buffer_state_dict(saved)
    redrawn = live.buffer.draw(8)
    assert [p.text for p in redrawn[:3]] == [p.text for p in whole[:3]]  # in flight at the save: first
    assert [(p.index, p.text) for p in redrawn[3:]] == [(p.index, p.text) for p in whole[3:]]
    assert live.ledger()["drawn"] == 8
