"""The run's own sections of its config: how its steps are scheduled (`loop`), where its processes
are placed (`placement`), the Ray cluster it runs on (`ray`) and the faults it injects on purpose
(`fault`). They configure no component: the orchestrator reads them while it wires and drives the
components, and the root run config (run_config.py) composes them beside the components' own
sections, so neither has to import the other.

A schedule is a function `(TrainContext) -> None` that runs steps `ctx.start_step + 1 ..
loop.num_steps` with the shared steps in orchestration/steps.py, chosen by name from SCHEDULES (a
user's own is given as `module:function`). What each fault does and when it fires:
orchestration/faults.py. Non-goal: checks across sections (run_checks.py).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from typing import Callable, Literal

from miles.config.loader import ConfigError
from miles.net import LOOPBACK
from miles.registry import Registry

SCHEDULES: Registry[Callable] = Registry("schedule", arity=1, hint=" (a function taking the TrainContext)")
SCHEDULES.register("sync", "miles.orchestration.sync_loop:run_sync_loop")
SCHEDULES.register("one_step_off", "miles.orchestration.one_step_off:run_one_step_off_loop")
SCHEDULES.register("fully_async", "miles.orchestration.async_loop:run_fully_async_loop")

@dataclass
class LoopConfig:
    schedule: str = "sync"
    """sync: generate → train → sync weights in turn; one_step_off: generate step k+1 while training
    step k; fully_async: engines never wait, the trainer collects finished groups from the buffer; or
    module:function, a schedule of your own."""
    num_steps: int = 20
    """RL training steps."""
    save_every: int = 0
    """Write a resumable checkpoint and a Hugging Face export every this many steps (0 = only at the
    end), in the background behind the next steps; `miles train --resume` and fault.restart_trainer
    go back to the newest one fully written."""
    update_weights_interval: int = 1
    """Push weights to the engines every this many steps."""
    pause_mode: Literal["none", "abort", "retract", "in_place"] = "none"
    """Overlapped schedules: how engines treat in-flight requests during a weight push. none: keep
    decoding, the new version is applied between two decode steps; abort: in-flight requests end
    (resumed from their prefix with rollout.partial_rollout, else their groups are retried);
    retract: requests are set aside and re-run under the new weights; in_place: decoding pauses and
    continues on the new weights with the KV cache kept."""
    collect_timeout_s: float = 1800.0
    """fully_async: fail the run if the trainer waits this long for one step's groups."""

    def validate(self) -> None:
        if self.num_steps < 0 or self.save_every < 0 or self.update_weights_interval < 1:
            raise ConfigError("loop.num_steps >= 0, loop.save_every >= 0, loop.update_weights_interval >= 1")
        if self.collect_timeout_s <= 0:
            raise ConfigError("loop.collect_timeout_s must be > 0")
        try:
            SCHEDULES.get(self.schedule)
        except ValueError as e:
            raise ConfigError(f"loop.schedule: {e}") from None

@dataclass
class PlacementConfig:
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: engines and trainer on separate device pools; colocated: they share all devices
    and take turns (sync schedule only)."""
    release_memory: list[str] = field(default_factory=lambda: ["weights", "kv_cache"])
    """colocated: what the engines free while the trainer works (SGLang's memory tags: weights,
    kv_cache). An empty list keeps both: on a host with memory for engines and trainer at once
    (a CPU machine, where the released weights go to a file) that skips writing and reading the
    engine's weights back every step."""
    pin_cpus: bool = True
    """On CPU, pin engine and trainer processes to disjoint cores."""
    engine_cpu_fraction: float = 0.5
    """Share of the cores given to the engine pool (the trainer gets the rest)."""
    trainer_nodes: str = ""
    """Ray custom resource that marks the nodes trainer ranks run on (a node started with
    `ray start --resources '{"NAME": 1}'`); empty: any node."""
    engine_nodes: str = ""
    """Ray custom resource that marks the nodes engines run on; empty: any node."""
    timeout_s: float = 120.0
    """How long a pool may wait for nodes to hold it before the run is refused."""

    def validate(self) -> None:
        if not 0 < self.engine_cpu_fraction < 1:
            raise ConfigError("placement.engine_cpu_fraction must be between 0 and 1")
        if self.mode == "colocated" and self.trainer_nodes != self.engine_nodes:
            raise ConfigError(f"placement.mode = 'colocated' shares devices, but placement.trainer_nodes = "
                              f"{self.trainer_nodes!r} and placement.engine_nodes = {self.engine_nodes!r} name "
                              "different nodes: name the same resource in both, or set placement.mode = "
                              "'disaggregated'")
        bad = [t for t in self.release_memory if t not in ("weights", "kv_cache")]
        if bad:
            raise ConfigError(f"placement.release_memory: {bad[0]!r} is not a memory kind; use weights, kv_cache "
                              "or both (an empty list keeps the engines' memory)")
        if self.timeout_s <= 0:
            raise ConfigError(f"placement.timeout_s = {self.timeout_s}: set it > 0 (seconds)")

    @property
    def separate_nodes(self) -> bool:
        """Whether trainer and engines are kept on different nodes (so they never share cores)."""
        return self.mode == "disaggregated" and self.trainer_nodes != self.engine_nodes

NAMESPACE = "miles"
"""The Ray namespace of a run with detached engines (ray.detached_engines), where its engines and their
placement group are named."""

LOCAL_NODE_ADDRESS = str(ipaddress.ip_address(LOOPBACK) + 1)
"""The address a local cluster's node advertises: loopback, and one Ray keeps as given (the address
after LOOPBACK, so a local run's traffic stays on loopback while Ray leaves its address alone)."""

@dataclass
class RayConfig:
    address: str | None = None
    """Existing cluster to join (e.g. "10.0.0.1:6379", "auto" for the latest `ray start` on this machine,
    or "ray://host:10001"); the environment variable RAY_ADDRESS counts as this key. None starts a
    local cluster of the run's own, even when another runs on this machine."""
    num_cpus: int | None = None
    """Logical CPUs of a local cluster (None = this machine's count); refused with `address`."""
    node_ip_address: str | None = None
    """Address of this machine's Ray node: a local cluster's node advertises it; when joining, the node
    of this machine that the driver attaches to (the --node-ip-address it was started with). None:
    LOCAL_NODE_ADDRESS (loopback) for a local cluster, Ray's choice when joining."""
    detached_engines: bool = False
    """On a joined cluster (ray.address): start the run's engines as detached Ray actors that outlive a
    killed driver, for `miles train --resume` to adopt; each ends itself once no driver renewed its
    lease for engine_lease_s."""
    engine_lease_s: float = 600.0
    """How long a detached engine serves on after its last driver stopped renewing its lease (seconds)."""

    def validate(self) -> None:
        if self.detached_engines and cluster_address(self) is None:
            raise ConfigError("ray.detached_engines needs a cluster that outlives the driver: set ray.address (or "
                              "RAY_ADDRESS); a local cluster ends with its driver, engines included")
        if self.engine_lease_s <= 0:
            raise ConfigError(f"ray.engine_lease_s = {self.engine_lease_s}: set it > 0 (seconds)")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"ray.num_cpus = {self.num_cpus}: set it >= 1, or leave it unset for this "
                              "machine's count")
        if self.address is not None and self.num_cpus is not None:
            raise ConfigError(f"ray.num_cpus = {self.num_cpus} with ray.address = {self.address!r}: a cluster "
                              "that is joined keeps the CPUs it was started with; unset ray.num_cpus, or unset "
                              "ray.address to start a local cluster")

def cluster_address(cfg: RayConfig) -> str | None:
    """The cluster to join: ray.address, else RAY_ADDRESS; None means start a local one."""
    return cfg.address or os.environ.get("RAY_ADDRESS") or None

@dataclass
class FaultConfig:
    kill_engine_every_s: float = 0.0
    """SIGKILL a serving engine every this many seconds (0 = never)."""
    stall_engine_every_s: float = 0.0
    """SIGSTOP a serving engine every this many seconds (0 = never); it stays stopped until replaced."""
    first_fault_after_s: float = 0.0
    """Seconds after the loop starts before the first engine fault (0 = one interval)."""
    max_engine_faults: int = 0
    """Stop injecting engine faults after this many kills and stalls together (0 = no limit)."""
    drop_response_prob: float = 0.0
    """Fraction of engine replies the router drops, answering 502 to the client instead."""
    delay_weight_sync_s: float = 0.0
    """Sleep this long before every weight push (a slow or congested transport)."""
    kill_trainer_at_step: int = 0
    """SIGKILL the last trainer rank as this step's training starts (0 = never); once per run, so a
    restarted trainer that trains the step again is left alone."""
    restart_trainer: bool = False
    """Recover when a trainer rank fails: start a new trainer group, go back to the last
    resumable checkpoint (trainer, buffer, ledger, data position, metrics) and go on. A checkpoint is
    written before the first step so there is always one; loop.save_every bounds the steps redone."""
    kill_engine_at_steps: list[int] = field(default_factory=list)
    """SIGKILL a serving engine (picked by seed) as each of these steps' training starts."""
    kill_trainer_at_steps: list[int] = field(default_factory=list)
    """SIGKILL the last trainer rank as each of these steps' training starts (with restart_trainer the
    run goes back to its last checkpoint; max_trainer_restarts must allow as many)."""
    kill_reward_worker_at_steps: list[int] = field(default_factory=list)
    """SIGKILL a worker of the reward process pool (rollout.reward_config.num_workers > 0) as each of
    these steps' training starts."""
    kill_router_at_steps: list[int] = field(default_factory=list)
    """SIGKILL the router process (router.own_process = true) as each of these steps' training starts."""
    stall_engine_at_steps: list[int] = field(default_factory=list)
    """SIGSTOP a serving engine (picked by seed) as each of these steps' weight push starts."""
    stall_resume_after_s: list[float] = field(default_factory=list)
    """Seconds after which each stall of stall_engine_at_steps, in order, is ended by SIGCONT; one value
    applies to every stall, 0 (or none given) is never: the health monitor then replaces the engine."""
    corrupt_delta_at_steps: list[int] = field(default_factory=list)
    """Flip a byte of the disk delta of each of these steps' weight push, after the trainer wrote it and
    before any engine reads it (sync.transport = 'disk_delta'): the engines' checksums must refuse it."""
    stall_engine_at_commit: list[int] = field(default_factory=list)
    """SIGSTOP a serving engine (picked by seed, on the driver's machine) in each of these steps' weight
    pushes, after every engine acknowledged the commit round's readiness and right before the commit is
    sent; never resumed. The engine is fenced: the others commit, it serves nothing and is replaced."""
    kill_driver_at_step: int = 0
    """SIGKILL the driver and its process group once this step's resumable checkpoint is committed
    (0 = never; loop.save_every must save that step); `miles train --resume RUN_DIR` goes on from it. The
    driver's own progress schedules it, so no later step starts first, and the resumed driver, which
    starts after that checkpoint, never fires it again. The router, a process of its own, outlives it."""
    max_trainer_restarts: int = 3
    """With restart_trainer: the most restarts in one run; the failure after that ends the run."""
    seed: int = 0
    """Seed for which engine each fault hits and which replies are dropped."""

    def validate(self) -> None:
        if min(self.kill_engine_every_s, self.stall_engine_every_s, self.first_fault_after_s,
               self.delay_weight_sync_s) < 0 or self.max_engine_faults < 0 or self.kill_trainer_at_step < 0 \
                or self.kill_driver_at_step < 0 or self.max_trainer_restarts < 0:
            raise ConfigError("fault.* intervals, delays and counts must be >= 0")
        if not 0 <= self.drop_response_prob < 1:
            raise ConfigError("fault.drop_response_prob must be in [0, 1)")
        for key in (*STEP_FAULTS.values(), *PUSH_FAULTS.values()):
            if any(type(v) is not int or v < 1 for v in getattr(self, key)):
                raise ConfigError(f"fault.{key} must list training steps (integers >= 1), got {getattr(self, key)}")
        resume = self.stall_resume_after_s
        if any(v < 0 for v in resume) or len(resume) not in (0, 1, len(self.stall_engine_at_steps)):
            raise ConfigError(f"fault.stall_resume_after_s = {resume}: give one value (seconds >= 0, 0 = never) "
                              f"for every stall, or one per step of fault.stall_engine_at_steps "
                              f"({len(self.stall_engine_at_steps)})")

    @property
    def active(self) -> bool:
        return bool(self.kill_engine_every_s or self.stall_engine_every_s or self.drop_response_prob
                    or self.delay_weight_sync_s or self.kill_trainer_at_step or self.kill_driver_at_step
                    or any(getattr(self, key) for key in (*STEP_FAULTS.values(), *PUSH_FAULTS.values())))

    def steps_of(self, kind: str) -> set[int]:
        """The steps a step-scheduled fault of this kind fires at."""
        steps = set(getattr(self, {**STEP_FAULTS, **PUSH_FAULTS}[kind]))
        if kind == "kill_trainer" and self.kill_trainer_at_step:
            steps.add(self.kill_trainer_at_step)
        return steps

ENGINE_FAULTS = ("kill_engine", "stall_engine", "stall_engine_at_commit")  # the faults the fleet recovers from

# Step-scheduled fault kinds, in the order they fire within one step (the trainer last: it ends the step),
# and the FaultConfig key listing each one's steps.
STEP_FAULTS = {"kill_reward_worker": "kill_reward_worker_at_steps", "kill_router": "kill_router_at_steps",
               "kill_engine": "kill_engine_at_steps", "kill_trainer": "kill_trainer_at_steps"}

# Faults that fire as a step's weight push starts.
PUSH_FAULTS = {"stall_engine": "stall_engine_at_steps", "corrupt_delta": "corrupt_delta_at_steps",
               "stall_engine_at_commit": "stall_engine_at_commit"}
