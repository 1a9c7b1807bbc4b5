"""Resumable trainer state: model, optimizer, LR schedule, critic, reference and RNG, written as
a torch.distributed checkpoint (each rank writes its own shards, in parallel).

A checkpoint is written into a staging folder and becomes visible by one rename (`commit`), after
the caller has added its own state (data position, buffer); `latest` names the newest one. A crash
mid-write leaves only a staging folder, which resume ignores.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

STAGING_SUFFIX = ".staging"


def _dcp_state(trainer, optimizers) -> dict:
    """The sharded state DCP saves and loads in place: model and optimizer, and the critic's when there
    is one (keys "model", "optim", "critic", "critic_optim")."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, optimizers)
    state = {"model": model_sd, "optim": optim_sd}
    if trainer.critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(trainer.critic, trainer.critic_optim)
    return state


def _all_optimizers(trainer, optimizers) -> list:
    return list(optimizers) + ([trainer.critic_optim] if trainer.critic is not None else [])


def _forget_unstarted(trainer, optimizers) -> None:
    """DCP gives an optimizer that has not stepped yet a state by taking a zero-lr step, which counts
    (Adam's bias correction then treats the first real step as its second). Dropping that state
    again leaves the optimizer exactly as it was before a checkpoint taken ahead of step 1."""
    for opt in _all_optimizers(trainer, optimizers):
        opt.state.clear()


def save_trainer_state(trainer, path: str) -> None:
    """Collective: every rank writes its shards under `path`."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with trainer.optim.materialized() as optimizers:
        started = any(opt.state for opt in _all_optimizers(trainer, optimizers))
        state = _dcp_state(trainer, optimizers)
        dcp.save(state, checkpoint_id=str(out / "dcp"))
        if not started:
            _forget_unstarted(trainer, optimizers)
    local = {
        "optimizer_started": started,
        "step": trainer.step,
        "schedulers": [s.state_dict() for s in trainer.optim.schedulers],
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    if trainer.reference is not None and trainer.reference.version:
        local["reference"] = trainer.reference.state_dict()
    torch.save(local, out / f"rank{trainer.rank}.pt")
    dist.barrier()


def load_trainer_state(trainer, path: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    src = Path(path)
    if not (src / "dcp").is_dir():
        raise FileNotFoundError(f"{path} is not a miles trainer checkpoint (no dcp/ folder inside)")
    local_path = src / f"rank{trainer.rank}.pt"
    if not local_path.exists():
        raise FileNotFoundError(f"{local_path} is missing: resume with the same trainer.num_ranks as the saved run")
    local = torch.load(local_path, weights_only=False)
    with trainer.optim.materialized() as optimizers:
        state = _dcp_state(trainer, optimizers)
        dcp.load(state, checkpoint_id=str(src / "dcp"))
        set_state_dict(trainer.model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if trainer.critic is not None:
            set_state_dict(trainer.critic, trainer.critic_optim, model_state_dict=state["critic"],
                           optim_state_dict=state["critic_optim"])
        if not local.get("optimizer_started", True):
            _forget_unstarted(trainer, optimizers)
    trainer.step = local["step"]
    for s, sd in zip(trainer.optim.schedulers, local["schedulers"]):
        s.load_state_dict(sd)
    torch.set_rng_state(local["torch_rng"])
    random.setstate(local["python_rng"])
    if "reference" in local and trainer.reference is not None:
        trainer.reference.load_state_dict(local["reference"])


def staging_path(final: str | Path) -> Path:
    final = Path(final)
    return final.with_name(final.name + STAGING_SUFFIX)


def commit(staging: str | Path, final: str | Path, meta: dict | None = None) -> Path:
    """Make a fully written staging folder the checkpoint `final`, atomically, and point
    `latest` (next to it) at it."""
    staging, final = Path(staging), Path(final)
    if meta is not None:
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    latest = final.parent / "latest"
    tmp = final.parent / "latest.tmp"
    tmp.write_text(final.name + "\n")
    os.replace(tmp, latest)
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
