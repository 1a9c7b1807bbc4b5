"""Background checkpoint writes (orchestration/checkpoints.py): one write at a time, a failed write
raised at the next wait and never committed, and a process killed in the middle of a write leaves
the previous checkpoint resumable (a real trainer on one gloo rank, in processes of its own)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from miles.orchestration.checkpoints import CheckpointWrites, commit_when_written
from miles.trainer.checkpoint import commit, fresh_staging, latest_checkpoint

WORKER = Path(__file__).with_name("checkpoint_worker.py")


def test_one_write_at_a_time_and_a_failed_one_is_raised_at_the_next_wait():
    writes, release = CheckpointWrites(), threading.Event()
    writes.start("state_1", release.wait)
    assert writes.in_progress
    with pytest.raises(RuntimeError, match="already in progress"):
        writes.start("state_2", lambda: None)
    release.set()
    writes.wait()
    assert not writes.in_progress and len(writes.write_s) == 1

    def fail():
        raise OSError("No space left on device")

    writes.start("state_2", fail)
    with pytest.raises(OSError, match="No space left"):
        writes.wait()
    writes.start("state_3", fail)
    assert writes.abandon() == "No space left on device"
    assert len(writes.write_s) == 1  # only the write that was committed is timed


class RanksDone:
    """Every rank reports its writes finished (what TrainerGroup.checkpoint_written returns)."""

    def checkpoint_written(self) -> None:
        pass


def test_a_checkpoint_missing_a_part_is_not_committed(tmp_path):
    folder = tmp_path / "checkpoints"
    first = fresh_staging(folder / "state_1")
    commit(first, folder / "state_1", {"step": 1})
    staging = fresh_staging(folder / "state_2")
    (staging / "dcp").mkdir()
    (staging / "dcp" / ".metadata").write_bytes(b"x")  # rank 1's own file never arrived
    (staging / "rank0.pt").write_bytes(b"x")
    with pytest.raises(RuntimeError, match=r"lacks \['rank1.pt'\].*not committed"):
        commit_when_written(RanksDone(), staging, folder / "state_2", {}, {"step": 2}, num_ranks=2)
    assert latest_checkpoint(folder) == folder / "state_1" and not (folder / "state_2").exists()


def test_a_process_killed_in_the_middle_of_a_write_leaves_the_previous_checkpoint_resumable(tiny_model_dir,
                                                                                               tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with (tmp_path / "crash.log").open("w") as log:
        crash = subprocess.Popen([sys.executable, str(WORKER), "crash", tiny_model_dir, str(tmp_path)],
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 900  # seconds on an idle machine; a loaded one is slower
            while not (tmp_path / "crash.json").exists():
                assert crash.poll() is None, (tmp_path / "crash.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the worker never reached its hanging write"
                time.sleep(0.1)
            os.kill(crash.pid, signal.SIGKILL)
            crash.wait()
        finally:
            if crash.poll() is None:
                crash.kill()
    crashed = json.loads((tmp_path / "crash.json").read_text())
    folder = tmp_path / "checkpoints"
    assert crashed["writing"]  # the step-2 write was still going when the step after it ran, and at the kill
    assert (folder / "latest").read_text().strip() == "state_1"
    assert not (folder / "state_2").exists() and (folder / "state_2.staging").is_dir()

    resumed = subprocess.run([sys.executable, str(WORKER), "resume", tiny_model_dir, str(tmp_path)],
                             capture_output=True, text=True, timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads((tmp_path / "resume.json").read_text())
    assert result["latest"] == "state_1"
    def figures(steps):
        return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in steps]  # timings differ

    assert figures(result["steps"]) == figures(crashed["steps"])  # steps 2 and 3 again, bit for bit
