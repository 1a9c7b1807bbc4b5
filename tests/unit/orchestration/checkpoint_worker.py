"""A save interrupted in the middle of its background write, on one real gloo rank, in a process
of its own. Driven by test_checkpoints.py:

    python checkpoint_worker.py crash  MODEL_DIR OUT_DIR   steps, a committed save, a second save whose
                                                           write never finishes, a step behind it; then
                                                           waits to be killed
    python checkpoint_worker.py resume MODEL_DIR OUT_DIR   a fresh trainer from `latest`, the same steps
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

from state_worker import step  # noqa: E402  (the trainer-state worker's batches and step)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    import miles.trainer.checkpoint as checkpoint
    from miles.config.loader import build
    from miles.net import free_port
    from miles.orchestration.checkpoints import CheckpointWrites, commit_when_written
    from miles.trainer.trainer import Trainer
    from miles.trainer.config import TrainerConfig

    mode, model, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    folder = out / "checkpoints"
    trainer = Trainer(build(TrainerConfig, {"lr": 1e-3}), model, 0, 1, "127.0.0.1", free_port())
    writes = CheckpointWrites()

    def save(step_no: int) -> None:
        """As TrainContext.save does it: snapshot, then finish and commit on the writer thread."""
        final = folder / f"state_{step_no}"
        staging = checkpoint.fresh_staging(final)
        trainer.save_checkpoint(str(staging), background=True)
        writes.start(final.name, lambda: commit_when_written(trainer, staging, final, {"step": step_no},
                                                             {"step": step_no}, 1))

    if mode == "resume":
        latest = checkpoint.latest_checkpoint(folder)
        trainer.load_checkpoint(str(latest))
        (out / "resume.json").write_text(json.dumps({"latest": latest.name, "steps": [step(trainer, 2),
                                                                                      step(trainer, 3)]}))
        return

    step(trainer, 0), step(trainer, 1)
    save(1)
    writes.wait()  # committed: the checkpoint a crash must leave resumable
    after = [step(trainer, 2)]
    # A disk that stops answering in the middle of the next write: this rank's own file never lands.
    real_write = checkpoint.fsync_write

    def stuck_write(path, write):
        if "state_2" in str(path):
            threading.Event().wait()
        real_write(path, write)

    checkpoint.fsync_write = stuck_write
    save(2)
    after.append(step(trainer, 3))  # the loop goes on while the write hangs
    tmp = out / "crash.json.tmp"
    tmp.write_text(json.dumps({"steps": after, "writing": writes.in_progress}))
    tmp.rename(out / "crash.json")
    time.sleep(600)  # until the test kills this process


if __name__ == "__main__":
    main()
