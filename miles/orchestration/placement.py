"""Where each component runs, decided in one place.

disaggregated (default): engines and trainer get disjoint device pools and can run concurrently.
On CPU a pool is a set of cores; each process pins its threads to its pool's cores.
colocated: both get every core and take turns (sync schedule only): while the trainer works the
engines release their memory (/release_memory_occupation). The trainer keeps its parameters
between steps (it pushes them right after training); its optimizer state can live off the device
between steps (trainer.offload_optimizer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from miles.config.loader import ConfigError


@dataclass
class PlacementConfig:
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: engines and trainer on separate device pools; colocated: they share all devices
    and take turns (sync schedule only)."""
    pin_cpus: bool = True
    """On CPU, pin engine and trainer processes to disjoint cores."""
    engine_cpu_fraction: float = 0.5
    """Share of the cores given to the engine pool (the trainer gets the rest)."""

    def validate(self) -> None:
        if not 0 < self.engine_cpu_fraction < 1:
            raise ConfigError("placement.engine_cpu_fraction must be between 0 and 1")


@dataclass(frozen=True)
class CorePools:
    engine: tuple[int, ...]
    trainer: tuple[int, ...]


def core_pools(cfg: PlacementConfig) -> CorePools | None:
    """Split this machine's usable cores into an engine pool and a trainer pool (None = no pinning)."""
    if not cfg.pin_cpus or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if cfg.mode == "colocated":
        return CorePools(engine=tuple(cores), trainer=tuple(cores))
    if len(cores) < 2:
        return None
    k = min(max(1, round(len(cores) * cfg.engine_cpu_fraction)), len(cores) - 1)
    return CorePools(engine=tuple(cores[:k]), trainer=tuple(cores[k:]))


def pin_current_process(cores: tuple[int, ...] | None) -> None:
    """Pin every thread of this process to `cores`; threads started later inherit the mask.

    sched_setaffinity(0) alone pins only the calling thread, and a Ray worker already runs several.
    """
    if not cores or not hasattr(os, "sched_setaffinity"):
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that exited meanwhile
            pass
