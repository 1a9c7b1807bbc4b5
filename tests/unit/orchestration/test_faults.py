"""Step-scheduled faults: each kind fires once, at its step, against a real process; the record in
faults.jsonl survives the driver, so a resumed run neither fires a fault twice nor forgets it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles.config.loader import ConfigError
from miles.orchestration.faults import FaultConfig, FaultInjector


class _Trainer:
    """The two things the injector asks of a trainer group: its ranks and their pids."""

    def __init__(self, pid: int):
        self.actors, self._pid = [object()], pid

    def pids(self) -> list[int]:
        return [self._pid]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_step_faults_fire_once_at_their_steps_and_a_resumed_run_remembers_them(tmp_path):
    trainer, worker = _sleeper(), _sleeper()
    log = tmp_path / "faults.jsonl"
    cfg = FaultConfig(kill_trainer_at_steps=[2], kill_reward_worker_at_steps=[3])
    try:
        faults = FaultInjector(cfg, log_path=log)
        faults.before_train(1, _Trainer(trainer.pid), lambda: [worker.pid])
        assert trainer.poll() is None and worker.poll() is None  # nothing due at step 1
        faults.before_train(2, _Trainer(trainer.pid), lambda: [worker.pid])
        assert trainer.wait(10) == -9 and worker.poll() is None
        again = _sleeper()  # the restarted trainer trains step 2 again: left alone
        faults.before_train(2, _Trainer(again.pid), lambda: [worker.pid])
        assert again.poll() is None

        resumed = FaultInjector(cfg, log_path=log)  # a new driver of the same run
        assert [(f.kind, f.step) for f in resumed.faults] == [("kill_trainer", 2)]
        resumed.before_train(2, _Trainer(again.pid), lambda: [worker.pid])
        assert again.poll() is None
        resumed.before_train(3, _Trainer(again.pid), lambda: [worker.pid])
        assert worker.wait(10) == -9
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        assert [(r["kind"], r["step"], r["pid"]) for r in rows] == [("kill_trainer", 2, trainer.pid),
                                                                   ("kill_reward_worker", 3, worker.pid)]
        assert resumed.report()["by_kind"] == {"kill_trainer": 1, "kill_reward_worker": 1}
    finally:
        for p in (trainer, worker, again):
            p.kill()
            p.wait()


def test_a_fault_with_nothing_to_hit_is_skipped_not_recorded(tmp_path):
    faults = FaultInjector(FaultConfig(kill_reward_worker_at_steps=[1], kill_router_at_steps=[1]),
                           log_path=tmp_path / "faults.jsonl")
    faults.before_train(1, _Trainer(0), lambda: [])  # no pool worker yet; the router is a thread
    assert faults.faults == [] and not (tmp_path / "faults.jsonl").exists()


@pytest.mark.parametrize("key", ["kill_engine_at_steps", "kill_trainer_at_steps", "kill_reward_worker_at_steps",
                                 "kill_router_at_steps"])
def test_a_step_list_that_is_not_steps_is_refused_by_name(key):
    with pytest.raises(ConfigError, match=f"fault.{key} must list training steps"):
        FaultConfig(**{key: [0]}).validate()
