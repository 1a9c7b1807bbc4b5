"""Where each component runs, decided in one place.

Nodes: each pool (trainer ranks, engines) is a Ray placement group with one bundle per process,
packed onto the nodes that `placement.trainer_nodes` / `placement.engine_nodes` name by a Ray custom
resource (`ray start --resources '{"engines": 1}'`), or onto any node when unnamed. A bundle asks for
a sliver of its resource: it chooses a node, it reserves nothing (cores are placement's business).

Cores, within a node: disaggregated (default): engines and trainer get disjoint device pools and can
run concurrently. On CPU a pool is a set of cores; each process pins its threads to its pool's cores
(only where both pools may share a node; pools on nodes of their own keep every core of it).
colocated: both get every core and take turns (sync schedule only): while the trainer works the
engines release their memory (/release_memory_occupation; `release_memory` says which kinds). The
trainer keeps its parameters between steps (it pushes them right after training); its optimizer
state can live off the device between steps (trainer.offload_optimizer).
GPUs: a pool whose processes compute on cuda asks for GPUs in each bundle (Ray then shows each
process its card through CUDA_VISIBLE_DEVICES). When the cluster has fewer GPUs than GPU processes,
they share cards in equal fractions (`gpu_shares`): one GPU holds a trainer rank and an engine at half
each, colocated or not, and each engine keeps to its memory_fraction of the card.
Non-goals: starting nodes (`ray start`), autoscaling, GPU topology (NVLink islands, NUMA).
"""

from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass

from miles.config.loader import ConfigError
from miles.devices import resolve
from miles.run_sections import PlacementConfig


@dataclass(frozen=True)
class CorePools:
    engine: tuple[int, ...]
    trainer: tuple[int, ...]


def core_pools(cfg: PlacementConfig) -> CorePools | None:
    """Split this machine's usable cores into an engine pool and a trainer pool (None = no pinning)."""
    if not cfg.pin_cpus or not hasattr(os, "sched_getaffinity") or cfg.separate_nodes:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if cfg.mode == "colocated":
        return CorePools(engine=tuple(cores), trainer=tuple(cores))
    if len(cores) < 2:
        return None
    k = min(max(1, round(len(cores) * cfg.engine_cpu_fraction)), len(cores) - 1)
    return CorePools(engine=tuple(cores[:k]), trainer=tuple(cores[k:]))


def resolve_threads(cfg, pools: CorePools | None):
    """`cfg` (a RunConfig) with num_threads = 0 (auto) made concrete for the trainer and the engines: each
    process's share of its pool's cores (colocated: every core each, as they take turns). Without pools
    (pinning off, or pools on nodes of their own) auto stays: each process takes every core it may use."""
    if pools is None:
        return cfg
    engine, trainer = cfg.rollout.engine, cfg.trainer
    if engine.num_threads == 0:
        engine = dataclasses.replace(engine, num_threads=max(1, len(pools.engine) // cfg.rollout.num_engines))
    if trainer.num_threads == 0:
        trainer = dataclasses.replace(trainer, num_threads=max(1, len(pools.trainer) // trainer.num_ranks))
    return dataclasses.replace(cfg, trainer=trainer, rollout=dataclasses.replace(cfg.rollout, engine=engine))


@dataclass(frozen=True)
class GpuShares:
    """GPUs each process of a pool asks Ray for (0: the pool computes on cpu)."""

    trainer: float = 0.0
    engine: float = 0.0


def gpu_shares(gpus: float, trainer_ranks: int, engines: int) -> GpuShares:
    """Split `gpus` among `trainer_ranks` and `engines` processes on cuda (0 for a pool on cpu): a whole
    GPU each where there are enough, else equal fractions (Ray accepts shares of 1/100)."""
    n = trainer_ranks + engines
    if n == 0:
        return GpuShares()
    if gpus < 1:
        raise ConfigError("the run puts its trainer or engines on cuda (trainer.device / rollout.engine.device), "
                          "but the Ray cluster offers no GPU: set them to 'cpu' (or 'auto'), or join a cluster "
                          "with GPUs (ray.address)")
    share = 1.0 if n <= gpus else int(100 * gpus / n) / 100
    if share < 0.01:
        raise ConfigError(f"{n} processes on cuda cannot share {gpus:g} GPU(s) (at most 100 per GPU): lower "
                          "trainer.num_ranks or rollout.num_engines")
    return GpuShares(trainer=share if trainer_ranks else 0.0, engine=share if engines else 0.0)


def place_devices(trainer_device: str, engine_device: str, gpus: float, trainer_ranks: int,
                  engines: int) -> tuple[str, str, GpuShares]:
    """The trainer's and the engines' devices made concrete for a cluster offering `gpus` GPUs (auto:
    cuda when it offers any), and each process's GPU share. `engines`: the engine processes the run
    starts itself (0 for engines started outside it, whose devices are their operator's)."""
    trainer = resolve(trainer_device, "trainer.device", gpu_present=gpus > 0)
    engine = resolve(engine_device, "rollout.engine.device", gpu_present=gpus > 0) if engines else engine_device
    shares = gpu_shares(gpus, trainer_ranks if trainer == "cuda" else 0, engines if engine == "cuda" else 0)
    return trainer, engine, shares


BUNDLE_SHARE = 0.001
"""How much of its node resource (or of CPU, when none is named) each bundle asks for."""


class PlacementError(RuntimeError):
    """The cluster has no nodes that can hold a pool."""


class NodePool:
    """One pool's placement group: `size` bundles packed onto the nodes that `resource` names.

    `options(i)` schedules an actor into bundle i (modulo the size: a replacement or an added engine
    shares a slot's bundle, which costs nothing since actors ask for no resources of their own).
    """

    def __init__(self, name: str, size: int, resource: str, key: str, timeout_s: float, gpus: float = 0.0,
                 detached_as: str | None = None):
        """`detached_as`: a detached placement group of that name (it outlives the driver), the one an
        earlier driver of the run left when it exists."""
        import ray
        from ray.util import get_placement_group
        from ray.util.placement_group import placement_group

        need = resource or "CPU"
        offered = ray.cluster_resources().get(need, 0)
        if offered < size * BUNDLE_SHARE:
            nodes = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
            raise PlacementError(f"{key} = {resource!r}: no node of the cluster offers the Ray resource {need!r} "
                                 f"(nodes: {', '.join(nodes)}); start one with `ray start --resources "
                                 f"'{{\"{need}\": 1}}' ...`, or leave {key} empty for any node")
        self.name, self.size, self.gpus = name, size, gpus
        bundle = {need: BUNDLE_SHARE, **({"GPU": gpus} if gpus else {})}
        self.group = None
        if detached_as:
            try:
                self.group = get_placement_group(detached_as)
            except ValueError:  # none left by an earlier driver
                pass
        if self.group is None:
            self.group = placement_group([bundle] * size, strategy="PACK", name=detached_as or f"miles-{name}",
                                         lifetime="detached" if detached_as else None)
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            raise PlacementError(f"{key} = {resource!r}: the {name} pool ({size} bundles) was not placed within "
                                 f"placement.timeout_s = {timeout_s:g}s; see `ray status` for the nodes' "
                                 "resources") from None

    def options(self, index: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=index % self.size), **({"num_gpus": self.gpus} if self.gpus else {})}

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


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
