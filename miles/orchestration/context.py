"""TrainContext: what a schedule drives — the run's config, its components, and the two versions.

A schedule (sync_loop, one_step_off, async_loop) only calls methods here and on the components it
holds; Ray appears in exactly two places (`call`, `submit`), so a schedule can be run in-process
against plain objects (tests/unit/orchestration/test_loops.py does).

Versions: `policy_version` counts the trainer's optimizer steps; `weight_version` is the newest one
pushed to the engines. They differ between a train step and its push, and by up to
`loop.update_weights_interval - 1` steps when pushes are spaced out.
Non-goals: starting or stopping components (driver.py does both).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from miles.run_config import RunConfig
from miles.metrics.progress import Progress
from miles.metrics.sink import Sink
from miles.orchestration.checkpoints import CheckpointWrites, commit_when_written
from miles.trainer.checkpoint import fresh_staging, latest_checkpoint

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from miles.orchestration.faults import FaultInjector
    from miles.orchestration.health import EngineFleet
    from miles.orchestration.trainer_group import TrainerGroup


def log(msg: str) -> None:
    print(f"[miles] {msg}", file=sys.stderr, flush=True)


@dataclass
class TrainContext:
    cfg: RunConfig
    run_dir: Path
    rollout: ActorHandle          # the RolloutManager actor (reached through `call` / `submit`)
    trainer: TrainerGroup
    sink: Sink
    progress: Progress
    fleet: EngineFleet | None = None      # keeps engines serving while the loop runs (None: no engines to watch)
    faults: FaultInjector | None = None   # set when the config asks for faults
    router_url: str | None = None         # the router the run started
    policy_version: int = 0     # optimizer steps the trainer has taken
    weight_version: int = 0     # the newest version pushed to the engines
    start_step: int = 0         # the step a resumed run continues after
    # one_step_off: a batch is being generated for the next step (saved, so that a resumed run
    # finishes that batch instead of drawing a new one)
    batch_in_flight: bool = False
    trainer_restarts: int = 0   # trainer groups replaced after a failure (fault.restart_trainer)
    # Set from a trainer group's failure until its replacement has restored the checkpoint: until then no
    # engine may be brought up (the new group would push the model's initial weights under a live version).
    trainer_restoring: bool = False
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)  # seconds the loop waited for each save (state + HF export)
    checkpoints: CheckpointWrites = field(default_factory=CheckpointWrites)  # the write in progress
    final_wait_s: float | None = None  # seconds the run's end waited for the last write
    _memory_warned: bool = False

    # -- the two places a schedule meets Ray -------------------------------------------------------
    def call(self, method, *args) -> Any:
        """Run an actor method and wait for its result."""
        import ray

        return ray.get(method.remote(*args))

    def submit(self, method, *args) -> Callable[[], Any]:
        """Start an actor method now; the returned function waits for and returns its result."""
        import ray

        ref = method.remote(*args)
        return lambda: ray.get(ref)

    # -- weights ----------------------------------------------------------------------------------
    def weights_lock(self):
        """Held while the trainer's weights move (train step, push), so an engine brought up meanwhile is
        pushed weights that match the version it is told."""
        return self.fleet.weights_lock if self.fleet is not None else contextlib.nullcontext()

    def sync_weights(self, version: int) -> dict:
        """Push the trainer's weights to every serving engine as `version` (engines that die meanwhile
        are replaced and the push goes to the rest)."""
        if self.faults is not None:
            self.faults.before_push(version, self.trainer)
        if self.fleet is None:
            return self.trainer.sync_weights(version)
        with self.fleet.weights_lock:
            return self.fleet.push(lambda: self.trainer.sync_weights(version))

    def engine_memory(self, action: str) -> None:
        """Colocated turn-taking on the engine side (release before training, resume after), of the
        memory kinds placement.release_memory names; none named, nothing to ask."""
        tags = self.cfg.placement.release_memory
        if not tags:
            return
        if not self.call(self.rollout.engine_memory, action, list(tags)) and not self._memory_warned:
            self._memory_warned = True
            log("colocated: the engines do not offer /release_memory_occupation; they keep their memory "
                "while the trainer works")

    # -- evaluation, records, checkpoints ---------------------------------------------------------
    def eval_due(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return step == self.cfg.loop.num_steps or (every > 0 and step % every == 0)

    def record(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append((step, metrics))

    def save(self, step: int) -> str:
        """This step's resumable checkpoint and Hugging Face export (returns the export's path). The
        loop waits only for the snapshot (and for the previous write, if it is still going); the
        writes finish in the background (`checkpoints.wait()`). save_s times what the loop waited."""
        t0 = time.perf_counter()
        path = self._save(step, export=True)
        self.save_s.append(time.perf_counter() - t0)
        return path

    def save_state(self, step: int) -> str:
        """Resumable checkpoint only (trainer state and RNGs, the buffer with its in-flight prompts,
        ledger and prompt position, versions), written in the background like `save`."""
        return self._save(step, export=False)

    def _save(self, step: int, export: bool) -> str:
        self.checkpoints.wait()  # one write at a time, committed in order
        folder = self.run_dir / "checkpoints"
        final = folder / f"state_{step}"
        staging = fresh_staging(final)
        trainer = self.trainer
        # The rollout side hands over its state while the ranks copy theirs: the loop is held here, so
        # neither the policy nor the versions move in between.
        rollout_state = self.submit(self.rollout.buffer_state_dict)
        trainer.save_checkpoint(str(staging), background=True)
        path = trainer.save_hf(str(folder / f"step_{step}"), background=True) if export else str(final)
        rollout = rollout_state()
        meta = {"step": step, "policy_version": self.policy_version, "weight_version": self.weight_version,
                "batch_in_flight": self.batch_in_flight}
        num_ranks = self.cfg.trainer.num_ranks
        self.checkpoints.start(final.name, lambda: commit_when_written(trainer, staging, final, rollout, meta,
                                                                       num_ranks))
        return path

    def wait_for_saves(self) -> None:
        """Until every checkpoint started is committed (the run's end; its wait is `final_wait_s`)."""
        t0 = time.perf_counter()
        self.checkpoints.wait()
        self.final_wait_s = time.perf_counter() - t0

    def checkpoint_cost(self) -> dict[str, float | int | None]:
        """What saving cost this run (resumable checkpoint + HF export, every loop.save_every steps and
        at the end): how many, the mean seconds the loop waited for one (the snapshot, and a previous
        write still going), that mean as a share of the mean step time (a step's record is written
        before its save, so perf/step_s leaves the save out), the mean seconds each took to be written
        in the background, and the wait for the last one at the run's end."""
        steps = [m["perf/step_s"] for _, m in self.history if m.get("perf/step_s")]
        mean = sum(self.save_s) / len(self.save_s) if self.save_s else None
        step = sum(steps) / len(steps) if steps else None
        writes = self.checkpoints.write_s
        return {"saves": len(self.save_s), "mean_save_s": mean, "mean_step_s": step,
                "save_share_of_step": mean / step if mean is not None and step else None,
                "mean_write_s": sum(writes) / len(writes) if writes else None,
                "final_wait_s": self.final_wait_s}

    def restore(self) -> None:
        """Continue from the run directory's latest resumable checkpoint: trainer state, buffer and
        prompt position, then the engines get the saved weights before they generate again."""
        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        if ckpt is None:
            raise SystemExit(f"miles: {self.run_dir} has no resumable checkpoint (checkpoints/latest); "
                             "runs save one at every loop.save_every steps and at the end")
        meta = json.loads((ckpt / "meta.json").read_text())
        self.trainer.load_checkpoint(str(ckpt))
        self.call(self.rollout.load_buffer_state_dict, json.loads((ckpt / "rollout.json").read_text()))
        self.start_step, self.policy_version = meta["step"], meta["policy_version"]
        self.batch_in_flight = meta.get("batch_in_flight", False)
        # Engines that outlived a failed trainer hold a later version than the checkpoint; a commit never
        # moves a version backwards, so they are relabelled to the checkpoint's before its weights go out.
        with self.weights_lock():
            self.trainer.relabel_engines(meta["policy_version"])
        self.sync_weights(meta["policy_version"])
        self.weight_version = meta["policy_version"]
        self.call(self.rollout.set_versions, self.policy_version, self.weight_version)
        log(f"resumed from {ckpt} at step {self.start_step}")

