"""The schedules, run in-process against a rollout side and a trainer that record what they are asked.

Ray is the true edge here: TrainContext meets it only in `call` and `submit`, which this context
runs in-process. What is checked is what a user would notice: who waits for whom, which version
each batch is trained from, when weights are pushed and engines paused, and that a run always
stops its producer.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from miles.buffer.types import Group, Sample
from miles.config import load_config
from miles.run_config import RunConfig
from miles.metrics.progress import Progress
from miles.orchestration.context import TrainContext
from miles.run_sections import SCHEDULES


class Rollout:
    """The rollout manager's surface the schedules use. Groups carry the engines' weight version at
    the moment their generation started, as real samples do."""

    def __init__(self, events: list, prompts_per_step: int = 2):
        self.events, self.n = events, prompts_per_step
        self.weight_version = 0
        self.next_index = 0

    def _groups(self, n: int) -> list[Group]:
        out = []
        for _ in range(n):
            samples = [Sample([1, 2], [3], [-0.5], [1], reward=r, weight_versions=[self.weight_version])
                       for r in (0.0, 1.0)]
            out.append(Group(samples, prompt_index=self.next_index))
            self.next_index += 1
        return out

    def generate_batch(self) -> dict:
        self.events.append(("generate", self.weight_version))
        self._ready = self._groups(self.n)
        return {"rollout/reward_mean": 0.5, "rollout/time_s": 0.0}

    def regenerate_in_flight(self) -> dict:
        self.events.append(("regenerate", self.weight_version))
        self._ready = self._groups(self.n)
        return {"rollout/time_s": 0.0}

    def collect(self, n: int | None = None, timeout_s: float | None = None):
        if n is not None:  # fully_async: the producer generated them meanwhile
            self.events.append(("collect", n, timeout_s))
            return self._groups(n), {}
        self.events.append(("collect",))
        return self._ready, {"buffer/ready": 0.0}

    def live_stats(self) -> dict:
        return {}

    def evaluate(self) -> dict:
        self.events.append(("evaluate", self.weight_version))
        return {"eval/accuracy": 0.25}

    def set_versions(self, policy: int, weight: int | None = None) -> None:
        if weight is not None:
            self.weight_version = weight
        self.events.append(("versions", policy, weight))

    def pause_engines(self, mode: str) -> None:
        self.events.append(("pause", mode))

    def continue_engines(self) -> None:
        self.events.append(("continue",))

    def engine_memory(self, action: str, tags: list[str] | None = None) -> bool:
        self.events.append(("memory", action) if tags == ["weights", "kv_cache"] else ("memory", action, tags))
        return True

    def start_producer(self) -> None:
        self.events.append(("start_producer",))

    def stop_producer(self) -> None:
        self.events.append(("stop_producer",))


class Trainer:
    def __init__(self, events: list, fail_push_at: int = 0, fail_train_at: int = 0):
        self.events, self.fail_push_at, self.fail_train_at = events, fail_push_at, fail_train_at
        self.steps = 0

    def train_groups(self, groups: list[Group]) -> dict:
        self.steps += 1
        if self.steps == self.fail_train_at:
            raise RuntimeError("trainer rank died")
        self.events.append(("train", sorted({g.oldest_weight_version for g in groups})))
        return {"train/loss": 0.1}

    def sync_weights(self, version: int) -> dict:
        if version == self.fail_push_at:
            raise RuntimeError("push failed")
        self.events.append(("push", version))
        return {"sync/transport_s": 0.0}


class Sink:
    def __init__(self):
        self.records: list[tuple[int, dict]] = []

    def write(self, step: int, metrics: dict) -> None:
        self.records.append((step, metrics))

    def close(self) -> None:
        pass


class InProcessContext(TrainContext):
    def call(self, method, *args):
        return method(*args)

    def submit(self, method, *args):
        result = method(*args)  # the work starts now, as an actor call would
        return lambda: result


def run(schedule: str, tmp_path: Path, events: list | None = None, fail_push_at: int = 0, fail_train_at: int = 0,
        resume_at: int = 0, batch_in_flight: bool = False, **settings) -> tuple[list, InProcessContext]:
    """Run `schedule` for 4 steps; `events` (if given) receives the record even when the run raises."""
    cfg = RunConfig()
    cfg.loop.schedule = schedule
    cfg.loop.num_steps = 4
    cfg.eval.every_steps = 2
    cfg.rollout.prompts_per_step = 2
    for dotted, value in settings.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    events = [] if events is None else events
    ctx = InProcessContext(cfg, tmp_path, Rollout(events), Trainer(events, fail_push_at, fail_train_at), Sink(),
                           Progress("test", 4, stream=io.StringIO(), mode="off"),
                           start_step=resume_at, policy_version=resume_at, weight_version=resume_at,
                           batch_in_flight=batch_in_flight)
    SCHEDULES.get(schedule)(ctx)
    return events, ctx


def kinds(events: list, *names: str) -> list:
    return [e for e in events if e[0] in names]


def test_sync_generates_trains_pushes_and_evaluates_in_turn_on_policy(tmp_path):
    events, ctx = run("sync", tmp_path)
    step1 = events[:events.index(("versions", 1, 1)) + 1]
    assert [e[0] for e in step1] == ["generate", "collect", "train", "push", "versions"]
    # Every batch is trained from the version it was generated under: on-policy.
    assert kinds(events, "train") == [("train", [v]) for v in range(4)]
    assert kinds(events, "push") == [("push", v) for v in range(1, 5)]
    # Evaluated every 2 steps and at the end, under the weights just pushed.
    assert kinds(events, "evaluate") == [("evaluate", 2), ("evaluate", 4)]
    assert ctx.policy_version == ctx.weight_version == 4
    assert [s for s, _ in ctx.sink.records] == [1, 2, 3, 4]
    assert all(m["perf/wait_data_s"] == m["perf/rollout_s"] for _, m in ctx.sink.records)


def test_spaced_pushes_leave_the_engines_behind_between_them(tmp_path):
    events, ctx = run("sync", tmp_path, loop__update_weights_interval=2, buffer__max_staleness=1)
    assert kinds(events, "push") == [("push", 2), ("push", 4)]
    assert ("versions", 1, None) in events and ("versions", 3, None) in events
    assert kinds(events, "train") == [("train", [0]), ("train", [0]), ("train", [2]), ("train", [2])]
    assert ctx.weight_version == 4


def test_colocated_sync_hands_the_cores_over_around_the_train_step(tmp_path):
    events, _ = run("sync", tmp_path, placement__mode="colocated")
    first = [e for e in events[:events.index(("push", 1)) + 1] if e[0] in ("memory", "train", "push")]
    assert first == [("memory", "release"), ("train", [0]), ("memory", "resume"), ("push", 1)]


def test_colocated_engines_release_only_the_memory_kinds_named_and_nothing_when_none_are(tmp_path):
    events, _ = run("sync", tmp_path / "kv", placement__mode="colocated", placement__release_memory=["kv_cache"])
    first = [e for e in events[:events.index(("push", 1)) + 1] if e[0] in ("memory", "train", "push")]
    assert first == [("memory", "release", ["kv_cache"]), ("train", [0]), ("memory", "resume", ["kv_cache"]),
                     ("push", 1)]
    events, _ = run("sync", tmp_path / "none", placement__mode="colocated", placement__release_memory=[])
    assert kinds(events, "memory") == [] and kinds(events, "push") == [("push", k) for k in (1, 2, 3, 4)]


def test_one_step_off_generates_the_next_batch_before_training_the_current_one(tmp_path):
    events, ctx = run("one_step_off", tmp_path)
    order = [e[0] for e in kinds(events, "generate", "train")]
    # gen 1, gen 2 (started before train 1), train 1, gen 3, train 2, gen 4, train 3, train 4.
    assert order == ["generate", "generate", "train", "generate", "train", "generate", "train", "train"]
    trained = [e[1][0] for e in kinds(events, "train")]
    assert trained == [0, 0, 1, 2]  # step k trains from version k-2 at the oldest: one behind its policy k-1
    assert ctx.policy_version == ctx.weight_version == 4


def test_overlapped_push_pauses_engines_and_always_lets_them_continue(tmp_path):
    events, _ = run("one_step_off", tmp_path, loop__pause_mode="abort")
    around = [e for e in events if e[0] in ("pause", "push", "continue")][:3]
    assert around == [("pause", "abort"), ("push", 1), ("continue",)]
    events = []
    with pytest.raises(RuntimeError, match="push failed"):
        run("one_step_off", tmp_path, events, fail_push_at=2, loop__pause_mode="in_place")
    assert events[-2:] == [("pause", "in_place"), ("continue",)]
    assert ("versions", 2, 2) not in events  # the failed version was never announced


def test_fully_async_collects_per_step_and_always_stops_its_producer(tmp_path):
    events, ctx = run("fully_async", tmp_path, loop__collect_timeout_s=7.0)
    assert events[0] == ("start_producer",) and events[-1] == ("stop_producer",)
    assert kinds(events, "collect") == [("collect", 2, 7.0)] * 4
    assert ctx.sink.records[-1][1]["buffer/groups_trained"] == 2
    events = []
    with pytest.raises(RuntimeError, match="trainer rank died"):
        run("fully_async", tmp_path, events, fail_train_at=2)
    assert events[-1] == ("stop_producer",)


def test_a_user_schedule_is_picked_up_from_the_run_config(tmp_path, tiny_model_dir):
    cfg = load_config(RunConfig, None, {"model.path": tiny_model_dir,
                                        "loop.schedule": "tests.helpers.user_schedule:generate_train_push",
                                        "loop.num_steps": "3"})
    events: list = []
    ctx = InProcessContext(cfg, tmp_path, Rollout(events), Trainer(events), Sink(),
                           Progress("test", 3, stream=io.StringIO(), mode="off"))
    SCHEDULES.get(cfg.loop.schedule)(ctx)
    assert kinds(events, "push") == [("push", 1), ("push", 2), ("push", 3)]
    assert not kinds(events, "evaluate")
    with pytest.raises(Exception, match="loop.schedule: .*must take 1 required positional"):
        load_config(RunConfig, None, {"model.path": tiny_model_dir, "loop.schedule": "miles.orchestration.steps:train_on"})


def test_resumed_one_step_off_finishes_the_batch_its_checkpoint_caught_in_flight(tmp_path):
    events, ctx = run("one_step_off", tmp_path, resume_at=2, batch_in_flight=True)
    # Step 3's batch was being generated at the step-2 checkpoint: it is completed, not drawn anew.
    assert [e[0] for e in kinds(events, "regenerate", "generate", "train")] == [
        "regenerate", "generate", "train", "train"]
    assert [s for s, _ in ctx.sink.records] == [3, 4]
    # The last step leaves no batch behind, so the final checkpoint says so.
    assert ctx.batch_in_flight is False
    events, _ = run("one_step_off", tmp_path, resume_at=2, batch_in_flight=False)
    assert kinds(events, "regenerate") == []  # a checkpoint with no batch in flight: a fresh one
