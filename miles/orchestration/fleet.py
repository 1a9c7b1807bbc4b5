"""The engine fleet: health probes, replacement of dead or stalled engines, re-admission of engines
the run did not start, elastic add and remove.

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
When an engine counts as dead is the run's one liveness section (`health`, miles/rollout/liveness.py),
which the router reads too: it quarantines at the same threshold the fleet replaces at.
A dead engine on the driver's node is SIGKILLed by pid (which also ends a stopped process); one on
another node is ended through its stop callback (Ray kills the actor there). Engines started outside
the run (rollout.engine_urls) are never killed, stopped or restarted by it.
Non-goals: trainer failures (collective timeouts end the step; `miles train --resume` continues).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from miles.net import bearer_headers
from miles.sync import shm
from miles.rollout.liveness import HealthConfig
from miles.versions import is_miles_version

log = logging.getLogger(__name__)

_MAX_FAILED_READMISSIONS = 3  # an engine that answers but keeps failing its bring-up is left out
_RESTARTED = "restarted"       # a probe's verdict that takes an engine out at once, whatever the threshold
REPLACE_TRIES, REPLACE_PAUSE_S = 4, 10.0  # a replacement that failed (e.g. its trainer died mid-push) starts over
RECONNECT_PAUSE_S = 2.0  # pause before reconnecting again after a failure no engine loss explains (x2 next)
ROUTER_OUTAGE_S = 60.0  # how long a router call waits for a router process that is being restarted


@dataclass
class EngineHandle:
    """One running engine process, however it was started."""

    url: str
    pid: int | None
    stop: Callable[[], None]  # ends the process and releases what holds it (actor, ...)
    external: bool = False    # started outside the run: never killed, stopped or restarted by it
    node: str | None = None   # address of the Ray node it runs on
    on_this_node: bool = True  # the pid is a process of this machine's node (so this process may signal it)
    signal_self: Callable[[int], None] | None = None  # asks the engine's process to signal itself (any node)

    @classmethod
    def outside(cls, url: str) -> EngineHandle:
        """An engine someone else started and will restart (rollout.engine_urls)."""
        return cls(url.rstrip("/"), None, lambda: None, external=True)

    def send_signal(self, sig: int) -> None:
        """Deliver `sig` to the engine's process, on whichever node it runs."""
        if self.on_this_node or self.signal_self is None:
            os.kill(self.pid, sig)
        else:
            self.signal_self(sig)

    def kill(self) -> None:
        if self.external:
            return
        if self.on_this_node:
            try:
                # SIGKILL also ends a SIGSTOPped process, which a polite shutdown would wait on forever.
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.stop()
        except Exception as exc:  # noqa: BLE001 - the process is gone either way
            log.debug("stopping %s after SIGKILL: %s", self.url, exc)
        # A killed engine cannot unlink its shared-memory weight buffers; on this host, do it for it.
        shm.reclaim_stale()


@dataclass
class Slot:
    index: int
    engine: EngineHandle | None
    state: str = "serving"          # serving | replacing | down (external, waiting to answer) | removed
    misses: int = 0
    first_miss: float | None = None
    failed_readmissions: int = 0     # in a row, for an external engine that answers but cannot be brought up
    record: Replacement | None = None  # a "down" slot's record, completed when its engine is re-admitted
    holds_pushed: bool = False       # an external engine reported a version miles pushed since its admission


@dataclass
class Replacement:
    """One engine declared dead and what became of its slot (wall-clock seconds, time.time()).

    kind "replaced": a new engine took the slot; "readmitted": an engine the run did not start,
    routed around until it answered again at the same URL (then started_at is when it answered)."""

    slot: int
    old_url: str
    old_pid: int
    reason: str
    first_miss: float
    detected_at: float
    new_url: str | None = None
    started_at: float | None = None
    pushed_at: float | None = None      # full weight push verified
    admitted_at: float | None = None
    error: str | None = None
    kind: str = "replaced"

    def public(self) -> dict:
        return dict(self.__dict__)


class FleetError(RuntimeError):
    """The fleet could not keep an engine serving (start-up, weight push or admission failed)."""


@dataclass
class EngineFleet:
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
        import httpx

        self._http = httpx.Client(headers=bearer_headers(self.admin_token), timeout=httpx.Timeout(30.0, connect=5.0))
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
        self._router("remove_worker", url)
        self.on_change(self.serving_urls())
        with self.weights_lock:
            self._reconnect()
        slot.engine.stop()

    # ---- monitoring ---------------------------------------------------------------------------------

    def start_monitor(self) -> None:
        for _ in range(self.cfg.standby_engines):
            self._start_standby()
        if self.cfg.enabled and self._monitor is None:
            self._monitor = threading.Thread(target=self._monitor_main, name="miles-health", daemon=True)
            self._monitor.start()

    def probe(self, url: str) -> str | None:
        """None if the engine generated a token within timeout_s, else why not."""
        import httpx

        try:
            r = self._http.get(url + "/health_generate", timeout=self.cfg.timeout_s)
        except httpx.TimeoutException as exc:
            # A full batch queues the probe's token behind it; an engine whose server still answers
            # is busy, not stalled (a stopped or wedged process answers neither).
            try:
                if self._http.get(url + "/health", timeout=self.cfg.timeout_s).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            return f"{type(exc).__name__}: no answer within health.timeout_s = {self.cfg.timeout_s:g}s"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if r.status_code == 200 or (r.status_code == 503 and "paused" in r.text):
            return None  # paused on purpose (a verified weight push, a pause mode): alive and answering
        return f"/health_generate answered {r.status_code}: {r.text[:120]}"

    def _probe_slot(self, slot: Slot, url: str) -> str | None:
        """probe(url), and for a serving engine the run did not start, whether it was restarted meanwhile."""
        err = self.probe(url)
        if err is not None or slot.state != "serving" or not slot.engine.external:
            return err
        version = self._version(url)
        if version is None:  # it answered /health_generate; the next round reads it again
            return None
        pushed = is_miles_version(version)
        if slot.holds_pushed and not pushed:
            return f"{_RESTARTED}: it held a version miles pushed and now reports {version!r}"
        slot.holds_pushed = slot.holds_pushed or pushed
        return None

    def _version(self, url: str):
        """The engine's weight version, or None when it cannot be read."""
        try:
            return self._http.get(url + "/get_model_info", timeout=self.cfg.timeout_s).json().get("weight_version")
        except Exception:  # noqa: BLE001 - unreadable now; the caller reads it again later
            return None

    def _monitor_main(self) -> None:
        with cf.ThreadPoolExecutor(16, thread_name_prefix="miles-probe") as pool:
            while not self._stop.wait(self.cfg.interval_s):
                try:
                    self._probe_round(pool, self.cfg.failure_threshold)
                except Exception:  # noqa: BLE001 - the monitor must outlive any one bad round
                    log.exception("health probe round failed")

    def _probe_round(self, pool, threshold: int) -> list[int]:
        with self._lock:
            serving = [(s, s.engine.url) for s in self.slots if s.state == "serving"]
            down = [(s, s.engine.url) for s in self.slots if s.state == "down"]
        now = time.time()
        results = list(pool.map(lambda su: self._probe_slot(*su), serving + down))
        for (slot, url), err in zip(down, results[len(serving):]):
            with self._lock:
                back = err is None and slot.state == "down" and not self._stop.is_set()
                if back:
                    slot.state = "replacing"
            if back:
                log.warning("engine %s answers again: bringing it to the fleet's weights", url)
                t = threading.Thread(target=self._readmit, args=(slot,), name=f"miles-readmit-{slot.index}",
                                     daemon=True)
                self._workers.append(t)
                t.start()
        failed = []
        for (slot, url), err in zip(serving, results[:len(serving)]):
            with self._lock:
                if slot.state != "serving" or slot.engine.url != url:
                    continue
                if err is None:
                    slot.misses, slot.first_miss = 0, None
                    continue
                slot.misses += 1
                slot.first_miss = slot.first_miss or now
                if slot.misses < threshold and not err.startswith(_RESTARTED):
                    continue
                slot.state = "replacing"
            failed.append(slot.index)
            self._declare_dead(slot, err)
        return failed

    def check_now(self) -> list[int]:
        """Probe every serving engine once, and replace each that misses (after a failed push, say)."""
        with cf.ThreadPoolExecutor(16, thread_name_prefix="miles-probe") as pool:
            return self._probe_round(pool, threshold=1)

    # ---- replacement ---------------------------------------------------------------------------------

    def _declare_dead(self, slot: Slot, reason: str) -> None:
        old = slot.engine
        rec = Replacement(slot.index, old.url, old.pid, reason, slot.first_miss or time.time(), time.time(),
                          kind="readmitted" if old.external else "replaced")
        with self._lock:
            self.replacements.append(rec)
            replaced = [r for r in self.replacements if r.kind == "replaced"]
            allowed = self.cfg.restart and len(replaced) <= self.cfg.max_replacements
        if old.external:
            return self._route_around(slot, rec)
        log.warning("engine %s (slot %d) is not answering (%s): replacing it", old.url, slot.index, reason)
        # Out of the router first, so no new request goes there while it is being put down.
        self._router("remove_worker", old.url, missing_ok=True)
        self.on_change(self.serving_urls())
        old.kill()
        if not allowed:
            with self._lock:
                slot.state = "removed"
            rec.error = "not replaced (health.restart is off or health.max_replacements reached)"
            with self.weights_lock:
                self._reconnect()
            return
        t = threading.Thread(target=self._replace, args=(slot, rec), name=f"miles-replace-{slot.index}", daemon=True)
        self._workers.append(t)
        t.start()

    def _route_around(self, slot: Slot, rec: Replacement) -> None:
        """An engine the run did not start stops answering: out of the router and of the next push,
        and its slot waits for it to answer again (its operator restarts it; miles cannot)."""
        log.warning("engine %s (started outside the run) is not answering (%s): routing around it until it "
                    "answers again", rec.old_url, rec.reason)
        self._router("remove_worker", rec.old_url, missing_ok=True)
        with self._lock:
            slot.state, slot.misses, slot.first_miss, slot.holds_pushed = "down", 0, None, False
            slot.record = rec
        self.on_change(self.serving_urls())

    def _readmit(self, slot: Slot) -> None:
        """The engine of a "down" slot answers again: bring it to the fleet's weights and admit it."""
        rec = slot.record
        rec.started_at, rec.pushed_at, rec.error = time.time(), None, None
        try:
            self._admit(slot, slot.engine, rec)
        except BaseException as exc:  # noqa: BLE001 - the fleet routes around it, as before it answered
            rec.error = f"{type(exc).__name__}: {exc}"
            slot.failed_readmissions += 1
            if slot.failed_readmissions >= _MAX_FAILED_READMISSIONS:
                with self._lock:
                    slot.state = "removed"
                log.error("engine %s answers but could not be brought up %d times in a row (%s): left out of "
                          "the run", rec.old_url, slot.failed_readmissions, rec.error)
            else:
                log.warning("engine %s answers again but could not be brought up (%s); trying again when it "
                            "next answers", rec.old_url, rec.error)
            return
        rec.admitted_at, rec.new_url, slot.failed_readmissions = time.time(), rec.old_url, 0
        log.warning("engine %s (slot %d) re-admitted at the fleet's weights, %.1fs after its first missed probe",
                    rec.old_url, slot.index, rec.admitted_at - rec.first_miss)

    def _replace(self, slot: Slot, rec: Replacement) -> None:
        """Bring a new engine up in the slot. A failed try (the trainer group died during the bring-up push,
        the new engine crashed) kills that engine and starts over with another, outside weights_lock, so a
        trainer group being restarted meanwhile can restore; after REPLACE_TRIES the run is told."""
        for attempt in range(REPLACE_TRIES):
            try:
                engine = self._take_engine(slot.index)
                rec.new_url, rec.started_at = engine.url, time.time()
                if self._stop.is_set():  # the run ended while it started
                    engine.stop()
                    return
                self._admit(slot, engine, rec)
                rec.admitted_at = time.time()
                log.warning("engine slot %d serving again at %s, %.1fs after its first missed probe",
                            slot.index, engine.url, rec.admitted_at - rec.first_miss)
                return
            except BaseException as exc:  # noqa: BLE001 - surfaced to the loop through `raise_if_failed`
                rec.error = f"{type(exc).__name__}: {exc}"
                if self._stop.is_set():  # the run is ending: nothing to replace it for
                    return
                if attempt + 1 < REPLACE_TRIES:
                    log.warning("replacing engine slot %d failed (%s); starting over", slot.index,
                                rec.error.splitlines()[0][:200])
                    if self._stop.wait(REPLACE_PAUSE_S):
                        return
                    continue
                self.error = FleetError(f"could not replace engine slot {slot.index} ({rec.old_url}): {rec.error}")
                log.error("%s", self.error)

    def _take_engine(self, index: int) -> EngineHandle:
        with self._lock:
            engine = self._standby.pop(0) if self._standby else None
        if engine is None:
            engine = self.start_engine(index)
        if self.cfg.standby_engines:
            self._start_standby()  # the next failure finds one ready again
        return engine

    def _admit(self, slot: Slot, engine: EngineHandle, rec: Replacement | None = None) -> None:
        deadline = time.monotonic() + self.cfg.admit_timeout_s
        try:
            with self.weights_lock:
                self.bring_up(engine.url)
                # Whether it now holds a version miles pushed, read here rather than left to the next probe
                # round: an engine restarted again before any round read it would otherwise go unnoticed.
                holds = engine.external and is_miles_version(self._version(engine.url))
                with self._lock:
                    # Serving from here on as far as weights go: the next push (which reconnects the main
                    # transport to the changed set first) includes it. The router admits it below.
                    slot.engine, slot.misses, slot.first_miss, slot.state = engine, 0, None, "serving"
                    slot.holds_pushed = holds
            if rec is not None:
                rec.pushed_at = time.time()
            self._router("add_worker", engine.url)
            # The router admits it once its weight version is the fleet's; a new engine brought up at a
            # version the others do not hold yet waits for the next push, which includes it.
            while not self._router_active(engine.url):
                if time.monotonic() > deadline:
                    raise FleetError(f"the router did not admit {engine.url} within health.admit_timeout_s = "
                                     f"{self.cfg.admit_timeout_s}s; see its /list_workers")
                time.sleep(0.05)
        except BaseException:
            if engine.external:
                self._router("remove_worker", engine.url, missing_ok=True)
            engine.kill()
            with self._lock:
                slot.state = "down" if engine.external else "removed"
            self.on_change(self.serving_urls())
            raise
        self.on_change(self.serving_urls())

    def _start_standby(self) -> None:
        def run():
            try:
                e = self.start_engine(-1)
            except Exception as exc:  # noqa: BLE001 - a later replacement starts its own engine instead
                log.warning("standby engine did not start: %s", exc)
                return
            finally:
                with self._lock:
                    self._standby_starting -= 1
            with self._lock:
                if self._stop.is_set():
                    e.stop()
                else:
                    self._standby.append(e)

        with self._lock:
            if len(self._standby) + self._standby_starting >= self.cfg.standby_engines:
                return
            self._standby_starting += 1
        threading.Thread(target=run, name="miles-standby", daemon=True).start()

    # ---- weight pushes ------------------------------------------------------------------------------

    def push(self, sync: Callable[[], dict]) -> dict:
        """Run one main weight push (the caller holds weights_lock) against the serving engines.

        An engine that fails during it is declared dead and the push is retried on the others
        (`sync/engine_loss_retries` counts these); with no engine serving there is nothing to push to,
        and replacements get the version at bring-up.
        """
        reconnect_retries = 0
        for tries in range(3):
            reconnect_retries += self._reconnect_absorbing_failures()
            if not self._transport_urls:
                return {}
            pushed_to = set(self._transport_urls)
            try:
                metrics = sync()
                if reconnect_retries:
                    metrics = {**metrics, "sync/reconnect_retries": reconnect_retries}
                return {**metrics, "sync/engine_loss_retries": tries} if tries else metrics
            except Exception as exc:  # noqa: BLE001 - re-raised below unless an engine explains it
                self.check_now()
                # Retry only if an engine of this push has since left the serving set (declared dead
                # by this check or by the monitor): any other failure is not the fleet's to absorb.
                gone = pushed_to - set(self.serving_urls())
                if not gone:
                    raise
                log.warning("weight push failed (%s); %s left the fleet, retrying on the engines serving",
                            str(exc).splitlines()[0][:200], sorted(gone))
        raise FleetError("weight push kept failing while engines died; see the health log above")

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

    def _router_call(self, method: str, path: str, **kwargs):
        """One call to the router; while nothing answers (a router process being restarted), again
        until ROUTER_OUTAGE_S have passed."""
        import httpx

        deadline = time.monotonic() + ROUTER_OUTAGE_S
        while True:
            try:
                return self._http.request(method, f"{self.router_url}{path}", **kwargs)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                if time.monotonic() > deadline or self._stop.is_set():
                    raise
                time.sleep(0.2)

    def _router(self, action: str, url: str, missing_ok: bool = False) -> None:
        r = self._router_call("POST", f"/{action}", params={"url": url})
        if r.status_code != 200 and not (missing_ok and r.status_code == 404):
            raise FleetError(f"router {self.router_url}/{action}?url={url} answered {r.status_code}: {r.text[:200]}")

    def _router_active(self, url: str) -> bool:
        workers = self._router_call("GET", "/list_workers").json()["workers"]
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
        self._http.close()
