"""Step-scheduled faults: each kind fires once, at its step, against a real process; the record in
faults.jsonl survives the driver, so a resumed run neither fires a fault twice nor forgets it. Push
faults fire as a step's weight push starts: a stalled engine (SIGSTOP) is resumed when its
stall_resume_after_s says, or never; a delta is damaged through the trainer."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from miles.config.loader import ConfigError
from miles.orchestration.faults import FaultInjector
from miles.orchestration.fleet import EngineHandle
from miles.run_sections import FaultConfig


class _Trainer:
    """The two things the injector asks of a trainer group: its ranks and their pids."""

    def __init__(self, pid: int):
        self.actors, self._pid = [object()], pid

    def pids(self) -> list[int]:
        return [self._pid]

    def damage_next_delta(self) -> bool:
        self.damaged = getattr(self, "damaged", 0) + 1
        return True


class _Fleet:
    """What the injector asks of a fleet: the engines serving."""

    def __init__(self, pid: int):
        self.engine = EngineHandle("http://127.0.0.1:1", pid, lambda: None)

    def serving(self):
        return [(0, self.engine)]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]  # R, S, T (stopped), ...


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
                                 "kill_router_at_steps", "stall_engine_at_steps", "corrupt_delta_at_steps"])
def test_a_step_list_that_is_not_steps_is_refused_by_name(key):
    with pytest.raises(ConfigError, match=f"fault.{key} must list training steps"):
        FaultConfig(**{key: [0]}).validate()


def test_push_faults_stall_an_engine_until_resumed_or_for_good_and_damage_a_delta_once(tmp_path):
    engine, trainer = _sleeper(), _Trainer(0)
    # Resumed after 2 s: time enough to see it stopped on a machine busy with other tests.
    cfg = FaultConfig(stall_engine_at_steps=[2, 4], stall_resume_after_s=[2.0, 0], corrupt_delta_at_steps=[3])
    faults = FaultInjector(cfg, _Fleet(engine.pid), log_path=tmp_path / "faults.jsonl")
    try:
        faults.before_push(1, trainer)
        assert _state(engine.pid) != "T" and not hasattr(trainer, "damaged")
        t0 = time.monotonic()
        faults.before_push(2, trainer)
        # Stopped as the push starts: the signal lands when the kernel next schedules the process, which
        # on a loaded machine can take a moment, so look for well under the 2 s it stays stopped.
        while _state(engine.pid) != "T" and time.monotonic() - t0 < 1.0:
            time.sleep(0.01)
        assert _state(engine.pid) == "T"  # ...
        while _state(engine.pid) == "T" and time.monotonic() - t0 < 12:
            time.sleep(0.05)
        assert 1.9 < time.monotonic() - t0 < 12 and engine.poll() is None  # ... and resumed 2 s later
        faults.before_push(2, trainer)  # the step pushed again after a restart: left alone
        assert _state(engine.pid) != "T"
        faults.before_push(3, trainer)
        faults.before_push(3, trainer)
        assert trainer.damaged == 1
        faults.before_push(4, trainer)
        time.sleep(1.0)
        assert _state(engine.pid) == "T"  # never resumed: the fleet's health monitor must replace it
        rows = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
        assert [(r["kind"], r["step"], r["resume_after_s"]) for r in rows] == [
            ("stall_engine", 2, 2.0), ("corrupt_delta", 3, 0.0), ("stall_engine", 4, 0.0)]
        assert faults.report()["by_kind"] == {"stall_engine": 2, "corrupt_delta": 1}
    finally:
        engine.kill()
        engine.wait()


def test_stall_resume_times_that_match_no_stall_are_refused_by_name():
    with pytest.raises(ConfigError, match="fault.stall_resume_after_s"):
        FaultConfig(stall_engine_at_steps=[2, 4, 6], stall_resume_after_s=[1, 2]).validate()


_DRIVER = """
import sys, time
from miles.orchestration.faults import FaultInjector
from miles.run_sections import FaultConfig
injector = FaultInjector(FaultConfig(kill_driver_at_step=2), log_path=sys.argv[1])
for step in (1, 2, 3):
    print("step", step, flush=True)
    injector.after_save(step, lambda: print("saved", step, flush=True))
print("past the kill", flush=True)
"""


def test_the_driver_kill_fires_after_its_steps_checkpoint_before_the_next_step_and_never_in_a_resumed_driver(tmp_path):
    # A stand-in driver in a process group of its own (as `miles bench chaos` starts `miles train`),
    # with a child in the same group: the kill takes the group once step 2's save has been waited for.
    log = tmp_path / "faults.jsonl"
    child = "import subprocess, sys; subprocess.Popen(['sleep', '60']); exec(sys.stdin.read())"
    done = subprocess.run([sys.executable, "-c", child, str(log)], input=_DRIVER, capture_output=True, text=True,
                          timeout=60, start_new_session=True)
    assert done.returncode == -9
    assert done.stdout.split("\n")[:4] == ["step 1", "step 2", "saved 2", ""]
    (fault,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert fault["kind"] == "kill_driver" and fault["step"] == 2
    # The resumed driver reads the record back: step 2 again (or any step) fires nothing.
    resumed = subprocess.run([sys.executable, "-c", _DRIVER, str(log)], capture_output=True, text=True, timeout=60)
    assert resumed.returncode == 0 and "past the kill" in resumed.stdout
    assert len(log.read_text().splitlines()) == 1
