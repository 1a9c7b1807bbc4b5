"""Ray actor shells around components that know nothing about Ray.

Each shell pins its process to its placement pool, sets torch's thread count, and forwards calls.
All actors ask Ray for no logical CPUs: cores are assigned by placement, not by Ray's scheduler.
Every address a shell binds or hands out is its Ray node's (ray_cluster.node_address): an engine
serves there unless told a host, and trainer rank 0 hosts the trainer's rendezvous and the
weight-update groups there, on ports it picks itself.
"""

from __future__ import annotations

import dataclasses
import os
import signal

from miles.net import free_port
from miles.orchestration.faults import damage_delta
from miles.orchestration.lease import Lease
from miles.orchestration.placement import pin_current_process
from miles.orchestration.ray_cluster import node_address
from miles.engine.server import start_server_thread
from miles.sglang.server import SGLangServer
from miles.sync.adapter import AdapterSync
from miles.sync.updater import WeightUpdater

class _ServerShell:
    """What the two engine shells share: a server (`self.server`) on this actor's node, and with a
    lease (a detached engine, ray.detached_engines) the end of the server and of this actor's process
    once no driver renewed it for that long (lease.py)."""

    server = None
    lease: Lease | None = None

    def renew_lease(self) -> None:
        if self.lease is not None:
            self.lease.renew()

    def _expire(self) -> None:
        self.server.stop()
        os._exit(0)  # the actor's process: Ray sees the detached actor gone and does not restart it

    def url(self) -> str:
        return self.server.url

    def node(self) -> str:
        return node_address()

    def stop(self) -> None:
        self.server.stop()


class EngineShell(_ServerShell):
    """One built-in engine serving the engine HTTP API from inside a Ray actor's process."""

    def __init__(self, engine_config, cores=None, lease_s: float | None = None):
        if not engine_config.host:
            engine_config = dataclasses.replace(engine_config, host=node_address())
        self.server = start_server_thread(engine_config)
        # Pinned once serving: start-up (imports, loading) may use any idle core, which matters when a
        # replacement starts while its pool's cores are busy generating.
        pin_current_process(cores)
        self.lease = Lease(lease_s, self._expire) if lease_s else None

    def signal(self, sig: int) -> None:
        """Signal this process (fault injection on an engine of another node); a kill never answers."""
        os.kill(os.getpid(), sig)

    def pid(self) -> int:
        return os.getpid()


class SGLangShell(_ServerShell):
    """One live SGLang server (miles/sglang/server.py) owned by a Ray actor: the server runs as a process
    group of its own, started by this actor's process and ended with it, on this actor's node and cores.
    `pid` and `signal` are the server's, so a fault injected into "the engine" hits SGLang itself."""

    def __init__(self, engine_config, sglang_config, routed_experts: bool = False, cores=None,
                 lease_s: float | None = None):
        if not engine_config.host:
            engine_config = dataclasses.replace(engine_config, host=node_address())
        # Pinned before the launch: the server's processes inherit this process's cores.
        pin_current_process(cores)
        self.server = SGLangServer(engine_config, sglang_config, routed_experts)
        self.lease = Lease(lease_s, self._expire) if lease_s else None

    def signal(self, sig: int) -> None:
        self.server.signal(sig)

    def pid(self) -> int:
        return self.server.pid


class TrainerShell:
    """One trainer rank (trainer/trainer.py on the configured backend). Rank 0 also owns the weight
    transport towards the engines."""

    def __init__(self, trainer_cfg, sync_cfg, model_path: str, rank: int, world_size: int, seed: int,
                 temperature: float, cores=None, admin_token: str | None = None):
        pin_current_process(cores)
        if not sync_cfg.master_address:  # engines join weight-update groups at this rank's node
            sync_cfg = dataclasses.replace(sync_cfg, master_address=node_address())
        self._args = (trainer_cfg, model_path, rank, world_size, seed, temperature)
        self.sync_cfg, self.rank, self.admin_token = sync_cfg, rank, admin_token
        self.trainer = None
        self.transport = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the trainer group's master, an address of this rank's node and a port free there."""
        host = node_address()
        return host, free_port(host)

    def start(self, master_address: str, master_port: int) -> str:
        """Join the trainer group at rank 0's master; returns this rank's node address."""
        # torch loads here, in the rank's own process: the driver that imports this module never needs it.
        from miles.trainer.trainer import Trainer

        trainer_cfg, model_path, rank, world_size, seed, temperature = self._args
        # The backend (trainer.backend) comes from the trainer's registry, BACKENDS.
        self.trainer = Trainer(trainer_cfg, model_path, rank, world_size, master_address, master_port,
                               seed=seed, temperature=temperature)
        return node_address()

    def train_step(self, minibatches, algorithm: str | None = None):
        """One step: an optimizer update per (seqs, totals) minibatch (Trainer.train_minibatches)."""
        try:
            return self.trainer.train_minibatches(minibatches, algorithm)
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            timeout = self.trainer.cfg.collective_timeout_s
            raise CollectiveTimeout(
                f"trainer rank {self.rank}: a collective did not complete within trainer.collective_timeout_s = "
                f"{timeout:g}s, so another rank has died or stalled; the step is abandoned. Continue from the "
                f"last checkpoint with `miles train --resume RUN_DIR` ({str(exc).splitlines()[0][:200]})") from None

    def pid(self) -> int:
        return os.getpid()

    def channels(self) -> dict[str, str]:
        """Rank 0: how weights reach each engine (see WeightUpdater.channels)."""
        said = getattr(self.transport, "channels", None) if self.rank == 0 else None
        return said() if said is not None else {}  # adapter-only sync (sync/adapter.py) says nothing

    def connect_engines(self, urls: list[str]) -> bool:
        """Rank 0 connects the updater; returns whether it needs `check_engines_start` (engines that
        speak only SGLang's protocol verify the transport once, before the run)."""
        if self.rank != 0:
            return False
        lora = self.trainer.cfg.lora
        if self.adapter_only:  # only the adapter travels, loaded by the engines themselves
            self.transport = AdapterSync(lora, self.admin_token, self.trainer.model_path, self.sync_cfg.timeout_s)
        else:
            self.transport = WeightUpdater(self.sync_cfg, self.admin_token, base_path=self.trainer.model_path)
        self.transport.connect(urls)
        return self.transport.needs_start_check

    @property
    def adapter_only(self) -> bool:
        """trainer.lora.sync = "adapter": weight sync is miles/sync/adapter.py, not a transport."""
        return bool(self.trainer.cfg.lora.rank) and self.trainer.cfg.lora.sync == "adapter"

    def check_engines_start(self) -> dict[str, float]:
        """Collective: every rank gathers the starting weights; rank 0 runs the updater's check_start."""
        named = self.trainer.full_named_tensors()
        try:
            return self.transport.check_start(named) if self.rank == 0 else {}
        finally:
            _drain(named)

    def reconnect_engines(self, urls: list[str]) -> None:
        """Point the weight transport at a changed set of engines; the updater keeps its history, so no
        engine is noise-filled again (new engines get `push_full` first)."""
        if self.rank != 0:
            return
        if self.transport is None:
            return self.connect_engines(urls)
        self.transport.connect(urls)

    def relabel_engines(self, version: int) -> None:
        if self.rank == 0 and self.transport is not None:
            self.transport.relabel(version)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Collective: every rank gathers; rank 0 converts, buckets, sends and verifies (sync/updater.py)."""
        if self.rank == 0 and self.transport is None:
            raise RuntimeError("sync_weights before connect_engines: the trainer has no route to the engines")
        return self._push(self.transport, version)

    def damage_next_delta(self) -> bool:
        """Rank 0, fault injection (fault.corrupt_delta_at_steps): the next version's delta files are
        damaged once written, before any engine reads them; False when no disk delta is written."""
        if self.rank != 0 or not isinstance(self.transport, WeightUpdater):
            return False
        return self.transport.tamper_next_version(damage_delta)

    def stall_next_commit(self, pid: int) -> bool:
        """Rank 0, fault injection (fault.stall_engine_at_commit): the next commit round SIGSTOPs process
        `pid` (an engine on this machine) after every engine acknowledged readiness, before the commit."""
        if self.rank != 0 or not isinstance(self.transport, WeightUpdater) or self.transport.plain:
            return False
        self.transport.stall_before_commit(lambda: os.kill(pid, signal.SIGSTOP))
        return True

    def push_full(self, urls: list[str], version: int) -> dict[str, float]:
        """Collective: bring new engines to `version` with a full push, noise-fill verified, over a
        transport of their own (the engines already serving are not paused or touched)."""
        if self.adapter_only:  # new engines hold the base weights already: they need the adapter in force
            return self.transport.push_current(urls, version) if self.rank == 0 else {}
        named = self.trainer.full_named_tensors()
        updater = None
        try:
            if self.rank != 0:
                return {}
            updater = WeightUpdater(self.sync_cfg.for_new_engines(), self.admin_token,
                                    base_path=self.trainer.model_path)
            updater.connect(urls)
            return updater.push(named, version)
        finally:
            _drain(named)
            if updater is not None:
                updater.close()

    def _push(self, updater, version: int) -> dict[str, float]:
        named = self.trainer.full_named_tensors(on_device=bool(getattr(updater, "takes_device_tensors", False)))
        try:
            return updater.push(named, version) if self.rank == 0 else {}
        finally:
            _drain(named)

    def save_hf(self, out_dir: str, background: bool = False):
        return self.trainer.save_hf(out_dir, background)

    def save_checkpoint(self, path: str, background: bool = False) -> None:
        self.trainer.save_checkpoint(path, background)

    def checkpoint_written(self) -> None:
        """Called in the actor's "checkpoint" concurrency group, so it can wait for the background
        writes while train steps and pushes go on in the default one."""
        self.trainer.checkpoint_written()

    def call_trainer(self, method: str, *args):
        """Forward any other trainer call (checkpoint save/load, ...) without a shell method each."""
        return getattr(self.trainer, method)(*args)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _drain(named) -> None:
    # Every rank must finish the gather even when rank 0's send failed part-way, or the others
    # would wait in the next all-gather until the collective timeout.
    for _ in named:
        pass


class CollectiveTimeout(RuntimeError):
    """A trainer collective outlived trainer.collective_timeout_s: a peer rank died or stalled."""


def remote(cls, max_concurrency: int = 1, concurrency_groups: dict[str, int] | None = None):
    """Wrap a shell as a Ray actor class that takes no logical CPUs.

    max_concurrency > 1 runs calls on a thread pool, so one call may block (a trainer waiting for
    groups) while others (version updates, evaluation) proceed. `concurrency_groups` adds named
    groups of threads of their own, which a call picks with `.options(concurrency_group=...)`.
    """
    import ray

    if concurrency_groups:
        return ray.remote(num_cpus=0, max_concurrency=max_concurrency, concurrency_groups=concurrency_groups)(cls)
    return ray.remote(num_cpus=0, max_concurrency=max_concurrency)(cls)
