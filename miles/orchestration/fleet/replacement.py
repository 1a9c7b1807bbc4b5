"""What the fleet does with an engine declared dead: replace it (a standby or a fresh start in its
slot, brought to the trainer's weights, admitted by the router), or, for an engine the run did not
start, route around it until it answers again and re-admit it. Also the standby engines and the
admission every new engine goes through (also add_engine's).

Who waits on whom: a bring-up holds weights_lock, so a new engine is brought up against weights
that match the version it is told (never a half-trained state). A failed try (the trainer group died
during the bring-up push, the new engine crashed) kills that engine and starts over with another,
outside weights_lock, so a trainer group being restarted meanwhile can restore.
Non-goals: deciding that an engine is dead (probing.py); the fleet's state (fleet.py).
"""

from __future__ import annotations

import logging
import threading
import time

from miles.engine_api import routes
from miles.orchestration.fleet.engines import EngineHandle, FleetError, Replacement, Slot
from miles.versions import is_miles_version

log = logging.getLogger(__name__)

_MAX_FAILED_READMISSIONS = 3  # an engine that answers but keeps failing its bring-up is left out
REPLACE_TRIES, REPLACE_PAUSE_S = 4, 10.0  # a replacement that failed (e.g. its trainer died mid-push) starts over


class Replacing:
    """EngineFleet's replacement half (the state is EngineFleet's)."""

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
        self._router(routes.REMOVE_WORKER, old.url, missing_ok=True)
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
        self._router(routes.REMOVE_WORKER, rec.old_url, missing_ok=True)
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
            self._router(routes.ADD_WORKER, engine.url)
            # The router admits it once its weight version is the fleet's; a new engine brought up at a
            # version the others do not hold yet waits for the next push, which includes it.
            while not self._router_active(engine.url):
                if time.monotonic() > deadline:
                    raise FleetError(f"the router did not admit {engine.url} within health.admit_timeout_s = "
                                     f"{self.cfg.admit_timeout_s}s; see its /list_workers")
                time.sleep(0.05)
        except BaseException:
            if engine.external:
                self._router(routes.REMOVE_WORKER, engine.url, missing_ok=True)
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
