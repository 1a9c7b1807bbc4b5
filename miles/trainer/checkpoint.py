"""Resumable trainer state: model, optimizer, LR schedule, critic, reference and RNG, written as
a torch.distributed checkpoint (each rank writes its own shards, in parallel).

A save has two halves. The snapshot copies the state to host memory (every tensor copied, so the
next optimizer step cannot change what is written) and takes the caller's time; the write (DCP
shards, the rank's own `rank*.pt`, each file fsynced) runs on the rank's `CheckpointWriter`
thread while training goes on. Writes of one rank run one at a time, in the order saved; their
collectives (DCP's plan exchange) go over a gloo group of their own, never interleaving with the
training's collectives on the default group. A backend saves its models and optimizers through
`save_trainer_state` (torch's distributed state dicts, which read FSDP2 shards, DTensor layouts and
plain modules alike); the trainer adds its own step, RNG and reference to the rank's file.

A checkpoint is written into a staging folder and becomes visible by one rename (`commit`), after
every rank's write has finished and the caller has added its own state (data position, buffer);
`latest` names the newest. A crash mid-write leaves only a staging folder, which resume ignores.
Non-goal: deciding when to save or who waits for a write (orchestration/checkpoints.py does).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

STAGING_SUFFIX = ".staging"


class CheckpointWriter:
    """One rank's background writes: each runs on one thread, one after another, in save order."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-checkpoint")
        self._pending: list[Future] = []
        self._group = None

    @property
    def group(self):
        """The gloo group the writes' own collectives use. Made on the first save, which every rank
        reaches together (creating a group is itself a collective on the default group)."""
        if self._group is None:
            import datetime

            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._group

    def submit(self, fn, *args) -> None:
        self._pending.append(self._pool.submit(fn, *args))

    def wait(self) -> None:
        """Until every write submitted so far is on disk; raises the first one's failure."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()


def host_copy(state):
    """`state` with every tensor (DTensor shards included) copied to host memory, the rest as is."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        return stager.stage(state)
    finally:
        stager.close()


def fsync_write(path: Path, write) -> None:
    """Write `path` through `write(file)` into a temporary name, fsync it, then rename it into place."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX: the directory entry lives in the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dcp_state(models, optimizers) -> dict:
    """The sharded state DCP saves and loads in place: model and optimizer, and the critic's when there
    is one (keys "model", "optim", "critic", "critic_optim")."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(models.model, optimizers)
    state = {"model": model_sd, "optim": optim_sd}
    if models.critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(models.critic, models.critic_optim)
    return state


def _all_optimizers(models, optimizers) -> list:
    return list(optimizers) + ([models.critic_optim] if models.critic is not None else [])


def _forget_unstarted(models, optimizers) -> None:
    """DCP gives an optimizer that has not stepped yet a state by taking a zero-lr step, which counts
    (Adam's bias correction then treats the first real step as its second). Dropping that state
    again leaves the optimizer exactly as it was before a checkpoint taken ahead of step 1."""
    for opt in _all_optimizers(models, optimizers):
        opt.state.clear()


def save_trainer_state(models, path: str, writer: CheckpointWriter, local: dict) -> None:
    """Snapshot this rank's state into host memory now and queue its write under `path` on
    `writer` (`writer.wait()` says when it is on disk). Every rank calls it, in the same order.

    `models` holds the rank's torch modules and optimizers (`model`, `optim`: an OptimizerSet,
    `critic`, `critic_optim`, `rank`); `local` is the trainer's own state (step, RNG, reference),
    kept in this rank's file next to the optimizer's schedules."""
    group = writer.group
    with models.optim.materialized() as optimizers:
        started = any(opt.state for opt in _all_optimizers(models, optimizers))
        state = host_copy(_dcp_state(models, optimizers))
        if not started:
            _forget_unstarted(models, optimizers)
    local = {"optimizer_started": started,
             "schedulers": copy.deepcopy([s.state_dict() for s in models.optim.schedulers]), **local}
    writer.submit(_write_trainer_state, state, local, Path(path), models.rank, group)


def _write_trainer_state(state: dict, local: dict, out: Path, rank: int, group) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    out.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(out / "dcp"), process_group=group)  # fsyncs each file it writes
    fsync_write(out / f"rank{rank}.pt", lambda f: torch.save(local, f))


def load_trainer_state(models, path: str) -> dict:
    """Restore `models` (as in `save_trainer_state`) and their schedules from `path`; returns this
    rank's file, whose trainer state the caller restores."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    src = Path(path)
    if not (src / "dcp").is_dir():
        raise FileNotFoundError(f"{path} is not a miles trainer checkpoint (no dcp/ folder inside)")
    local_path = src / f"rank{models.rank}.pt"
    if not local_path.exists():
        raise FileNotFoundError(f"{local_path} is missing: resume with the same trainer.num_ranks as the saved run")
    local = torch.load(local_path, weights_only=False)
    with models.optim.materialized() as optimizers:
        state = _dcp_state(models, optimizers)
        dcp.load(state, checkpoint_id=str(src / "dcp"))
        set_state_dict(models.model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if models.critic is not None:
            set_state_dict(models.critic, models.critic_optim, model_state_dict=state["critic"],
                           optim_state_dict=state["critic_optim"])
        if not local.get("optimizer_started", True):
            _forget_unstarted(models, optimizers)
    for s, sd in zip(models.optim.schedulers, local["schedulers"]):
        s.load_state_dict(sd)
    return local


def rng_state() -> dict:
    """torch's and Python's random states, for a rank's checkpoint file."""
    import torch

    return {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}


def restore_rng(local: dict) -> None:
    import torch

    torch.set_rng_state(local["torch_rng"])
    random.setstate(local["python_rng"])


def staging_path(final: str | Path) -> Path:
    final = Path(final)
    return final.with_name(final.name + STAGING_SUFFIX)


def fresh_staging(final: str | Path) -> Path:
    """An empty staging folder for `final` (what a crashed earlier attempt left there is removed, so
    no stale file can be committed with the new checkpoint)."""
    staging = staging_path(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def missing_parts(staging: str | Path, num_ranks: int) -> list[str]:
    """The parts of a trainer checkpoint not (yet) in `staging`: DCP's metadata, which its coordinator
    writes only after every rank's shards, and each rank's own file."""
    staging = Path(staging)
    want = ["dcp/.metadata"] + [f"rank{r}.pt" for r in range(num_ranks)]
    return [p for p in want if not (staging / p).is_file()]


def commit(staging: str | Path, final: str | Path, meta: dict | None = None) -> Path:
    """Make a fully written staging folder the checkpoint `final`, atomically, and point
    `latest` (next to it) at it."""
    staging, final = Path(staging), Path(final)
    if meta is not None:
        fsync_write(staging / "meta.json", lambda f: f.write((json.dumps(meta, indent=2) + "\n").encode()))
    old = None
    if final.exists():  # the same step saved again (the run's end): the old copy goes once the new is in place
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old)
    fsync_write(final.parent / "latest", lambda f: f.write((final.name + "\n").encode()))
    fsync_dir(final.parent)
    return final


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest committed checkpoint under `folder` (None if there is none)."""
    folder = Path(folder)
    pointer = folder / "latest"
    if pointer.exists():
        path = folder / pointer.read_text().strip()
        if path.is_dir():
            return path
    return None
