"""The engine fleet: health probes (probing.py), replacement of dead or stalled engines and
re-admission of engines the run did not start (replacement.py), elastic add and remove.

    monitor thread ── GET /health_generate (timeout) ──► every serving engine, every interval_s
        │ failure_threshold misses in a row: dead, or alive but not answering (stalled)
        ▼
    replace(slot): the router drops it ─► its process is killed ─► a new engine takes the slot
        (a standby already started, or a fresh start; the slot's node and cores, a new port)
        ─► bring_up(url): full weight push at the trainer's version, noise-fill verified
        ─► router /add_worker, which admits it only at the fleet's weight version ─► serving
        (the main weight transport reconnects to the changed set at the start of the next push; with
        disk_delta that push brings the newcomer's local copy from the base to the fleet's version)

Engines the run did not start (`rollout.engine_urls`, e.g. SGLang servers) go through the same
probes and the same admission, but miles cannot restart them:

    declared dead ─► the router drops it (routed around), its slot waits ("down"); no kill
        ─► probed every interval_s until it answers again (restarted by its operator, un-stalled)
        ─► bring_up(url): full weight push at the trainer's version ─► router admission ─► serving
    An engine restarted faster than its probes missed is caught by its weight version: once it held a
    version miles pushed (a number), a label miles never sends ("default", SGLang's first) means a new
    process holding other weights, and it is routed around and brought up the same way.

The run never pauses for this: the other engines keep generating; the router retries the dead
engine's in-flight requests on live engines, and groups that still fail go back to the buffer as
"gave up" (retried). A weight push that an engine dies in is retried on the engines still serving.

Calls to the router that find nothing listening (a router process being restarted, see
router_supervisor.py) are made again for up to ROUTER_OUTAGE_S.

Who waits on whom: replacement and the loop's train/push share `weights_lock`, so a new engine is
brought up against weights that match the version it is told (never a half-trained state), and
the main transport is never reconnected during a push.
When an engine counts as dead is the run's one liveness section (`health`) and its one checker
(miles/rollout/liveness.py), which the router uses too: it quarantines at the same threshold the fleet
replaces at.
A dead engine on the driver's node is SIGKILLed by pid (which also ends a stopped process); one on
another node is ended through its stop callback (Ray kills the actor there). Engines started outside
the run (rollout.engine_urls) are never killed, stopped or restarted by it.
Non-goals: trainer failures (collective timeouts end the step; `miles train --resume` continues).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from miles.engine_api import routes
from miles.engine_api.client import EngineClient
from miles.engine_api.errors import EngineError
from miles.orchestration.fleet.engines import EngineHandle, FleetError, Replacement, Slot
from miles.orchestration.fleet.probing import Probing
from miles.orchestration.fleet.replacement import Replacing
from miles.rollout.liveness import HealthConfig, Liveness

log = logging.getLogger(__name__)

RECONNECT_PAUSE_S = 2.0  # pause before reconnecting again after a failure no engine loss explains (x2 next)
ROUTER_OUTAGE_S = 60.0  # how long a router call waits for a router process that is being restarted


@dataclass
class EngineFleet(Probing, Replacing):
    """Owns the engines of a run: starts them, watches them, replaces them, grows and shrinks.

    start_engine(slot) starts one engine process; bring_up(url) pushes the trainer's current weights
    fully to a new engine and verifies them; reconnect(urls) points the main weight transport at
    exactly these engines; on_change(urls) tells the rollout side the serving set.
    """

    cfg: HealthConfig
    start_engine: Callable[[int], EngineHandle]
    router_url: str
    admin_token: str | None = None
    bring_up: Callable[[str], None] = lambda url: None
    reconnect: Callable[[list[str]], None] = lambda urls: None
    on_change: Callable[[list[str]], None] = lambda urls: None
    slots: list[Slot] = field(default_factory=list)
    replacements: list[Replacement] = field(default_factory=list)
    weights_lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self):
        self._client = EngineClient(admin_token=self.admin_token, timeout_s=30.0, connect_timeout_s=5.0)
        self.liveness = Liveness(self.cfg, self._client)
        self._lock = threading.Lock()          # slots, standbys, replacement records
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._standby: list[EngineHandle] = []
        self._standby_starting = 0
        self._workers: list[threading.Thread] = []
        self._transport_urls: list[str] = []
        self.error: BaseException | None = None  # a replacement that failed; the loop raises it

    # ---- membership -------------------------------------------------------------------------------

    def adopt(self, engines: list[EngineHandle], standby: list[EngineHandle] = ()) -> None:
        """Take the engines the run started with (already connected to the router and the transport)
        and standby engines started with them."""
        with self._lock:
            for e in engines:
                self.slots.append(Slot(len(self.slots), e))
            self._transport_urls = [e.url for e in engines]
            self._standby.extend(standby)

    def serving_urls(self) -> list[str]:
        with self._lock:
            return [s.engine.url for s in self.slots if s.state == "serving"]

    def serving(self) -> list[tuple[int, EngineHandle]]:
        with self._lock:
            return [(s.index, s.engine) for s in self.slots if s.state == "serving"]

    def add_engine(self) -> str:
        """Grow the fleet by one engine, brought up and admitted like a replacement; returns its URL."""
        with self._lock:
            slot = Slot(len(self.slots), None, state="replacing")
            self.slots.append(slot)
        try:
            engine = self._take_engine(slot.index)
        except BaseException:
            slot.state = "removed"  # never started: nothing to route around or wait for
            raise
        self._admit(slot, engine)
        return engine.url

    def remove_engine(self, url: str) -> None:
        """Shrink the fleet: the router stops sending to the engine, then it is stopped."""
        with self._lock:
            slot = next((s for s in self.slots if s.state == "serving" and s.engine.url == url), None)
            if slot is not None:
                slot.state = "removed"
        if slot is None:
            raise ValueError(f"{url} is not a serving engine of this fleet; serving: {self.serving_urls()}")
        self._router(routes.REMOVE_WORKER, url)
        self.on_change(self.serving_urls())
        with self.weights_lock:
            self._reconnect()
        slot.engine.stop()

    # ---- weight pushes ------------------------------------------------------------------------------

    def push(self, sync: Callable[[], dict]) -> dict:
        """Run one main weight push (the caller holds weights_lock) against the serving engines.

        An engine that fails during it is declared dead and the push is retried on the others
        (`sync/engine_loss_retries` counts these); with no engine serving there is nothing to push to,
        and replacements get the version at bring-up.
        """
        reconnect_retries = fenced = 0
        for tries in range(3):
            reconnect_retries += self._reconnect_absorbing_failures()
            if not self._transport_urls:
                return {}
            pushed_to = set(self._transport_urls)
            try:
                metrics = sync()
                if reconnect_retries:
                    metrics = {**metrics, "sync/reconnect_retries": reconnect_retries}
                if fenced:
                    metrics = {**metrics, "sync/fenced_engines": fenced}
                return {**metrics, "sync/engine_loss_retries": tries} if tries else metrics
            except Exception as exc:  # noqa: BLE001 - re-raised below unless an engine explains it
                fenced += self.fence(_fenced_by(exc), str(exc).splitlines()[0][:300])
                self.check_now()
                # Retry only if an engine of this push has since left the serving set (declared dead
                # by this check or by the monitor): any other failure is not the fleet's to absorb.
                gone = pushed_to - set(self.serving_urls())
                if not gone:
                    raise
                log.warning("weight push failed (%s); %s left the fleet, retrying on the engines serving",
                            str(exc).splitlines()[0][:200], sorted(gone))
        raise FleetError("weight push kept failing while engines died; see the health log above")

    def fence(self, urls, reason: str) -> int:
        """Engines that did not acknowledge a commit the rest of the fleet made (sync/updater.py's
        FencedEngines): out of the router at once, then replaced (or, started outside the run, routed
        around until they answer and are brought to the fleet's weights by a full push). Returns how
        many engines of the fleet it names (the health monitor may have taken a stalled one out already)."""
        with self._lock:
            named = [s for s in self.slots if s.engine is not None and s.engine.url in set(urls)]
            slots = [s for s in named if s.state == "serving"]
            for s in named:
                s.held = True
            for s in slots:
                s.state = "replacing"
        for s in slots:
            self._declare_dead(s, f"fenced: {reason}")
        return len(named)

    def _reconnect(self) -> None:
        urls = self.serving_urls()
        if set(urls) != set(self._transport_urls):
            if urls:
                self.reconnect(urls)
            self._transport_urls = urls

    def _reconnect_absorbing_failures(self) -> int:
        """Reconnect; if it fails, try again (three tries in all): an engine that died meanwhile is
        dropped by the health check, and one that was only stalled (a stopped process, a long pause)
        may answer a few seconds later. Returns how many tries failed before one succeeded."""
        for attempt in range(3):
            before = set(self.serving_urls())
            try:
                self._reconnect()
                return attempt
            except Exception as exc:  # noqa: BLE001 - re-raised after the last try
                self.check_now()
                if attempt == 2:
                    raise
                left = set(self.serving_urls()) != before
                log.warning("reconnecting the weight transport failed (%s); %s, retrying",
                            str(exc).splitlines()[0][:200],
                            "an engine left the fleet" if left else "no engine left the fleet")
                if not left:
                    time.sleep(RECONNECT_PAUSE_S * (attempt + 1))

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    # ---- router -------------------------------------------------------------------------------------

    def _router_call(self, method: str, path: str, params: dict | None = None):
        """One call to the router; while nothing answers (a router process being restarted), again
        until ROUTER_OUTAGE_S have passed."""
        deadline = time.monotonic() + ROUTER_OUTAGE_S
        while True:
            try:
                return self._client.send(method, self.router_url, path, params=params)
            except EngineError as exc:
                if not exc.unreachable or time.monotonic() > deadline or self._stop.is_set():
                    raise
                time.sleep(0.2)

    def _router(self, path: str, url: str, missing_ok: bool = False) -> None:
        r = self._router_call("POST", path, params={"url": url})
        if r.status_code != 200 and not (missing_ok and r.status_code == 404):
            raise FleetError(f"router {self.router_url}{path}?url={url} answered {r.status_code}: {r.text[:200]}")

    def _router_active(self, url: str) -> bool:
        workers = self._router_call("GET", routes.LIST_WORKERS).json()["workers"]
        return any(w["url"] == url and not w["quarantined"] for w in workers)

    # ---- report and shutdown -------------------------------------------------------------------------

    def report(self) -> dict:
        with self._lock:
            recs = [r.public() for r in self.replacements]
        done = [r for r in recs if r["admitted_at"] is not None]
        return {"replacements": len(recs), "recovered": len(done),
                "readmissions": sum(r["kind"] == "readmitted" for r in done),
                "mean_recovery_s": (sum(r["admitted_at"] - r["first_miss"] for r in done) / len(done)
                                    if done else None),
                "events": recs}

    def metrics(self) -> dict[str, float]:
        """fleet/... figures for the step's record: engines serving and waiting now, and the run's totals."""
        with self._lock:
            states = [s.state for s in self.slots]
            recs = list(self.replacements)
        return {"fleet/serving_engines": float(states.count("serving")),
                "fleet/down_engines": float(states.count("down")),
                "fleet/engines_declared_dead": float(len(recs)),
                "fleet/replacements": float(sum(r.kind == "replaced" and r.admitted_at is not None for r in recs)),
                "fleet/readmissions": float(sum(r.kind == "readmitted" and r.admitted_at is not None for r in recs))}

    def close(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=self.cfg.timeout_s + 5)
        for t in self._workers:
            t.join(timeout=5)
        with self._lock:
            engines = [s.engine for s in self.slots if s.engine is not None and s.state != "removed"]
            engines += self._standby
            self._standby = []
        for e in engines:
            try:
                e.stop()
            except Exception:  # noqa: BLE001 - shutting down; the process may already be gone
                pass
        self._client.close()


def _fenced_by(exc: BaseException) -> tuple[str, ...]:
    """The engines a failed push fenced: FencedEngines' `fenced`, also through Ray's wrapping of it (its
    `cause`) and the trainer group's (a TrainerFailure raised from Ray's error)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        urls = getattr(e, "fenced", None)
        if urls:
            return tuple(urls)
        todo += [getattr(e, "cause", None), e.__cause__]
    return ()
