"""Fault injection: break a running job on purpose, to show it survives.

    --fault.kill_engine_every_s 30    SIGKILL a serving engine every 30 s
    --fault.stall_engine_every_s 30   SIGSTOP one (alive, holding its port, answering nothing)
    --fault.drop_response_prob 0.05   the router answers 502 instead of passing on 5% of engine replies
    --fault.delay_weight_sync_s 2     every weight push starts 2 s late
    --fault.kill_trainer_at_step 3    SIGKILL the last trainer rank as step 3's training starts (once)
    --fault.restart_trainer true      a failed trainer group is restarted from the last checkpoint
    --fault.kill_engine_at_steps 2,5           SIGKILL a serving engine as these steps start
    --fault.kill_trainer_at_steps 3,6          SIGKILL the last trainer rank as these steps start
    --fault.kill_reward_worker_at_steps 4      SIGKILL a reward process-pool worker as these steps start
    --fault.kill_router_at_steps 6             SIGKILL the router process (router.own_process) likewise
    --fault.stall_engine_at_steps 7            SIGSTOP a serving engine as these steps' weight pushes start
    --fault.stall_resume_after_s 8             ... and SIGCONT it 8 s later (0: never; the fleet replaces it)
    --fault.corrupt_delta_at_steps 9           damage the disk delta of this step's push once it is written
    --fault.stall_engine_at_commit 5           SIGSTOP a serving engine in this step's push, between the commit
                                               round's readiness check and its commit (never resumed)
    --fault.kill_driver_at_step 2              SIGKILL the driver's process group once step 2's resumable
                                               checkpoint is committed; `miles train --resume RUN_DIR` goes on

Timed engine faults pick a serving engine at random (seeded) and are spaced by their interval; the
health monitor (fleet.py) must find and replace each. Step-scheduled kills fire as the step's
training starts, and the push faults (a stalled engine, a damaged delta) as the step's weight push
starts, so a fast machine and a slow one get the same faults at the same points of the run; each
fires once per run (a step trained or pushed again after a restart is left alone). A push fault
must end in a rollback (no engine commits the version) and a retry within the push's deadlines
(sync/updater.py): the engine stopped for longer than one call's deadline (sync.timeout_s) fails
the attempt, and so does a delta whose bytes no longer match their checksums. A stall at commit must
end with the engine fenced (the others commit and serve the version, it serves nothing and is
replaced). Every injected
fault is recorded with its wall-clock time, so recovery can be measured from the moment of the
fault, not of its detection, and appended to the run directory's `faults.jsonl`, which a run
resumed by a new driver reads back: its report counts the faults before the resume, and none fires
twice.
Engines are signalled on whichever node they run (fleet.EngineHandle.send_signal); a trainer rank
only on the driver's machine, and a stall at commit (sent by the trainer's source rank, the one that
commits) only to an engine on the driver's machine. Non-goals: network partitions, disk faults.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from miles.run_sections import ENGINE_FAULTS, PUSH_FAULTS, STEP_FAULTS, FaultConfig

log = logging.getLogger(__name__)


@dataclass
class InjectedFault:
    kind: str       # kill_engine | stall_engine | stall_engine_at_commit | kill_trainer | kill_reward_worker |
    #                 kill_router | corrupt_delta (a stall at commit: `at` is when it was armed)
    target: str     # the engine URL, "trainer rank N", "reward worker", "router URL" or "weight version N"
    pid: int        # the process signalled (for corrupt_delta: the trainer rank that writes the delta)
    at: float       # time.time() when the signal was sent
    step: int = 0   # the step a step-scheduled fault fired at (0: a timed one)
    resume_after_s: float = 0.0  # stall_engine at a step: SIGCONT this long after the SIGSTOP (0: never)


class FaultInjector:
    """Drives the configured faults against a fleet (fleet.EngineFleet) and a trainer group."""

    def __init__(self, cfg: FaultConfig, fleet=None, log_path: str | os.PathLike | None = None, router=None):
        self.cfg, self.fleet, self.log_path, self.router = cfg, fleet, log_path, router
        self.faults: list[InjectedFault] = []
        if log_path is not None and os.path.exists(log_path):  # an earlier driver of this run injected these
            with open(log_path) as f:
                self.faults = [InjectedFault(**json.loads(line)) for line in f if line.endswith("\n")]
        self._lock = threading.Lock()
        self._rng = random.Random(cfg.seed)
        self._drop_rng = random.Random(cfg.seed + 1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- engine faults (a background thread) -------------------------------------------------------

    def start(self) -> None:
        kinds = [(k, every) for k, every in (("kill_engine", self.cfg.kill_engine_every_s),
                                             ("stall_engine", self.cfg.stall_engine_every_s)) if every > 0]
        if kinds and self.fleet is not None:
            self._thread = threading.Thread(target=self._main, args=(kinds,), name="miles-faults", daemon=True)
            self._thread.start()

    def _main(self, kinds) -> None:
        t0 = time.monotonic()
        due = {k: t0 + (self.cfg.first_fault_after_s or every) for k, every in kinds}
        every = dict(kinds)
        while not self._stop.is_set():
            kind = min(due, key=due.get)
            if self._stop.wait(max(0.0, due[kind] - time.monotonic())):
                return
            if self.cfg.max_engine_faults and self._engine_faults() >= self.cfg.max_engine_faults:
                return
            if self.engine_fault(kind) is None:
                due[kind] = time.monotonic() + 0.2  # every engine is being replaced: try again shortly
            else:
                due[kind] = time.monotonic() + every[kind]

    def _engine_faults(self) -> int:
        return sum(f.kind in ENGINE_FAULTS and not f.step for f in self.faults)

    def engine_fault(self, kind: str) -> InjectedFault | None:
        """Kill or stall one serving engine now; None when no engine is serving."""
        serving = self.fleet.serving()
        if not serving:
            return None
        _, engine = self._rng.choice(serving)
        sig = signal.SIGKILL if kind == "kill_engine" else signal.SIGSTOP
        fault = InjectedFault(kind, engine.url, engine.pid, time.time())
        try:
            engine.send_signal(sig)
        except ProcessLookupError:
            return None
        self._record(fault)
        log.warning("fault injection: %s %s (pid %d)", kind, engine.url, engine.pid)
        return fault

    def _record(self, fault: InjectedFault) -> None:
        with self._lock:
            self.faults.append(fault)
            if self.log_path is not None:
                with open(self.log_path, "a") as f:
                    f.write(json.dumps(fault.__dict__) + "\n")

    # ---- hooks the loop and the router call ----------------------------------------------------------

    def drop_response(self) -> bool:
        return self.cfg.drop_response_prob > 0 and self._drop_rng.random() < self.cfg.drop_response_prob

    def before_push(self, version: int, trainer=None) -> None:
        """As the push of `version` (the step that trained it) starts: the delay, then the push faults
        due at that step, each once per run."""
        if self.cfg.delay_weight_sync_s:
            time.sleep(self.cfg.delay_weight_sync_s)
        fired = {(f.kind, f.step) for f in self.faults}
        if version in self.cfg.steps_of("stall_engine") and ("stall_engine", version) not in fired:
            self._stall_at(version)
        if version in self.cfg.steps_of("stall_engine_at_commit") and ("stall_engine_at_commit", version) not in fired:
            self._stall_at_commit(version, trainer)
        if version in self.cfg.steps_of("corrupt_delta") and ("corrupt_delta", version) not in fired:
            if trainer is None or not trainer.damage_next_delta():
                log.warning("fault injection: the trainer writes no disk delta at step %d (sync.transport is "
                            "not disk_delta); corrupt_delta skipped", version)
                return
            fault = InjectedFault("corrupt_delta", f"weight version {version}", trainer.pids()[0], time.time(),
                                  version)
            log.warning("fault injection: corrupt_delta of weight version %d (written by pid %d)", version, fault.pid)
            self._record(fault)

    def _stall_at(self, step: int) -> None:
        serving = self.fleet.serving() if self.fleet is not None else []
        if not serving:
            log.warning("fault injection: no engine is serving at step %d; stall_engine skipped", step)
            return
        _, engine = self._rng.choice(serving)
        resume = self.cfg.stall_resume_after_s
        steps = self.cfg.stall_engine_at_steps
        after = (resume[steps.index(step)] if len(resume) > 1 else resume[0]) if resume and step in steps else 0.0
        fault = InjectedFault("stall_engine", engine.url, engine.pid, time.time(), step, after)
        try:
            engine.send_signal(signal.SIGSTOP)
        except ProcessLookupError:
            log.warning("fault injection: engine %s was gone at step %d; stall_engine skipped", engine.url, step)
            return
        self._record(fault)
        log.warning("fault injection: stall_engine %s (pid %d) at step %d, %s", engine.url, engine.pid, step,
                    f"resumed in {after:g}s" if after else "never resumed")
        if after:
            timer = threading.Timer(after, _resume, args=(engine,))
            timer.daemon = True
            timer.start()

    def _stall_at_commit(self, step: int, trainer) -> None:
        """Arm the trainer's next commit round to SIGSTOP one engine between its readiness check and its commit."""
        serving = [(i, e) for i, e in (self.fleet.serving() if self.fleet is not None else [])
                   if e.on_this_node and e.pid is not None]
        if not serving:
            log.warning("fault injection: no engine serving on this machine at step %d; stall_engine_at_commit "
                        "skipped", step)
            return
        _, engine = self._rng.choice(serving)
        if trainer is None or not trainer.stall_next_commit(engine.pid):
            log.warning("fault injection: the engines have no staged commit at step %d (plain SGLang servers); "
                        "stall_engine_at_commit skipped", step)
            return
        fault = InjectedFault("stall_engine_at_commit", engine.url, engine.pid, time.time(), step)
        self._record(fault)
        log.warning("fault injection: stall_engine_at_commit %s (pid %d) armed for step %d's commit round",
                    engine.url, engine.pid, step)

    def before_train(self, step: int, trainer, reward_workers: Callable[[], list[int]] = list) -> None:
        """The step-scheduled faults due at this step, each once per run; `reward_workers` lists the
        reward pool's worker pids."""
        fired = {(f.kind, f.step) for f in self.faults}
        for kind in STEP_FAULTS:
            if step not in self.cfg.steps_of(kind) or (kind, step) in fired:
                continue
            if kind == "kill_trainer":
                rank = len(trainer.actors) - 1
                fault = InjectedFault(kind, f"trainer rank {rank}", trainer.pids()[rank], time.time(), step)
            elif kind == "kill_engine":
                serving = self.fleet.serving() if self.fleet is not None else []
                if not serving:
                    log.warning("fault injection: no engine is serving at step %d; kill_engine skipped", step)
                    continue
                _, engine = self._rng.choice(serving)
                fault = InjectedFault(kind, engine.url, engine.pid, time.time(), step)
            elif kind == "kill_router":
                pid = getattr(self.router, "pid", None)
                if pid is None:
                    log.warning("fault injection: the router has no process of its own at step %d (router."
                                "own_process is false); kill_router skipped", step)
                    continue
                fault = InjectedFault(kind, f"router {self.router.url}", pid, time.time(), step)
            else:
                pids = reward_workers()
                if not pids:
                    log.warning("fault injection: the reward pool has no worker at step %d (is "
                                "rollout.reward_config.num_workers 0?); kill_reward_worker skipped", step)
                    continue
                fault = InjectedFault(kind, "reward worker", self._rng.choice(pids), time.time(), step)
            log.warning("fault injection: %s %s (pid %d) at step %d", kind, fault.target, fault.pid, step)
            self._record(fault)
            try:
                os.kill(fault.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def after_save(self, step: int, wait_for_saves: Callable[[], None]) -> None:
        """fault.kill_driver_at_step: once this step's checkpoint is committed (`wait_for_saves`), the
        driver's whole process group is SIGKILLed, as an operator's kill -9 of the job would; recorded
        first, so the resumed driver's report counts it and never fires it again."""
        if step != self.cfg.kill_driver_at_step or any(f.kind == "kill_driver" for f in self.faults):
            return
        wait_for_saves()
        fault = InjectedFault("kill_driver", "driver", os.getpid(), time.time(), step)
        self._record(fault)
        log.warning("fault injection: kill_driver (process group %d) after step %d's checkpoint", os.getpgrp(), step)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    # ---- report -------------------------------------------------------------------------------------

    def report(self, replacements: list[dict] | None = None) -> dict:
        """Injected faults, and for engine faults whether and how fast their slot served again."""
        by_pid = {r["old_pid"]: r for r in replacements or []}
        rows, recovery = [], []
        for f in self.faults:
            row = dict(f.__dict__)
            r = by_pid.get(f.pid)
            if f.kind in ENGINE_FAULTS:
                row["recovered"] = bool(r and r["admitted_at"])
                if row["recovered"]:
                    row["recovery_s"] = r["admitted_at"] - f.at
                    recovery.append(row["recovery_s"])
            rows.append(row)
        engine = [f for f in self.faults if f.kind in ENGINE_FAULTS]
        return {"kills": sum(f.kind == "kill_engine" for f in engine),
                "stalls": sum(f.kind == "stall_engine" for f in engine),
                "by_kind": dict(Counter(f.kind for f in self.faults)),
                "recovered": len(recovery),
                "mean_recovery_s": sum(recovery) / len(recovery) if recovery else None,
                "max_recovery_s": max(recovery) if recovery else None,
                "faults": rows}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _resume(engine) -> None:
    """SIGCONT a stalled engine; one the fleet replaced meanwhile is gone, and stays so."""
    try:
        engine.send_signal(signal.SIGCONT)
        log.warning("fault injection: engine %s (pid %d) resumed", engine.url, engine.pid)
    except Exception as exc:  # noqa: BLE001 - ProcessLookupError here, an actor error on another node
        log.warning("fault injection: engine %s was not resumed (%s)", engine.url, exc)


def damage_delta(paths: list[str]) -> None:
    """Flip one byte in the middle of the first shard of each delta directory (fault.corrupt_delta_at_steps):
    the zstd frame's checksum, or failing that the tensor's bound xxh3, no longer matches."""
    for path in paths:
        shards = sorted(f for f in os.listdir(path) if f.startswith("shard-"))
        if not shards:
            continue
        with open(os.path.join(path, shards[0]), "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
