"""Background checkpoint writes: the loop snapshots, one writer thread finishes and commits.

A save (`TrainContext.save`) holds the loop only while the trainer ranks copy their state to host
memory and the rollout manager hands over its buffer state. The rest happens on the thread that
`CheckpointWrites.start` starts, while the next steps run:

    loop:    save k ─ snapshot ─┐            step k+1 ...            save k+1 ─ wait ─ snapshot ─┐
    writer:                     └─ ranks' writes ─ rollout.json ─ check ─ commit(k) ┘             └─ ...

- A checkpoint is resumable only once every part is written and checked: until the commit (one
  rename, then `latest` moves) it is a staging folder, which resume ignores. A crash of a rank or
  of the driver mid-write leaves `latest` on the previous checkpoint.
- One write at a time: a save first waits for the previous write; that wait counts as save time.
- The run's end waits for the last write, and a trainer restart waits for (or gives up on) the
  write its failed group was making before it goes back to `latest`.
Non-goals: what a checkpoint holds (trainer/checkpoint.py, the rollout manager's state dict).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable

from miles.trainer.checkpoint import commit, fsync_write, missing_parts


class CheckpointWrites:
    """The run's checkpoint write in progress (at most one) and how long the writes took."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.write_s: list[float] = []  # seconds from each snapshot to its commit, in the background

    def start(self, name: str, finish: Callable[[], None]) -> None:
        """Run `finish` (wait for the ranks, write the rest, commit) on the writer thread."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint write is already in progress: wait() for it first")

        def run() -> None:
            t0 = time.perf_counter()
            try:
                finish()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits next
                self._error = exc
            else:
                self.write_s.append(time.perf_counter() - t0)

        # A daemon: a driver that is ending on an error does not stay up for a write it cannot commit.
        self._thread = threading.Thread(target=run, name=f"miles-checkpoint-{name}", daemon=True)
        self._thread.start()

    @property
    def in_progress(self) -> bool:
        return self._thread is not None

    def wait(self) -> None:
        """Until the write in progress is committed; raises its failure (then nothing was committed)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def abandon(self) -> str | None:
        """Let the write in progress end either way (after a trainer failure its ranks are gone, so it
        ends at once); returns why it was not committed, if it was not."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - the caller goes back to the last committed one
            return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None


def commit_when_written(trainer, staging: Path, final: Path, rollout: dict, meta: dict, num_ranks: int) -> Path:
    """The writer thread's part of a save: wait for every rank's writes (`trainer.checkpoint_written`,
    a TrainerGroup or one rank's trainer), add the rollout side's state, check that every part is
    there, then commit. Any failure raises before the commit, so `latest` stays where it was."""
    trainer.checkpoint_written()
    fsync_write(staging / "rollout.json", lambda f: f.write(json.dumps(rollout).encode()))
    missing = missing_parts(staging, num_ranks)
    if missing:
        raise RuntimeError(f"checkpoint {final} lacks {missing} after every rank's write; not committed")
    return commit(staging, final, meta)
