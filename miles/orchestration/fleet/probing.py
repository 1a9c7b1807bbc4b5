"""The fleet's health monitor: every interval_s each serving engine is probed (rollout/liveness.py's
`generating` probe, the one verdict the router's shares), misses are counted per slot, and an engine
past the threshold is handed to replacement; a "down" slot (an engine the run did not start) is
probed until it answers again and is then re-admitted.

An engine the run did not start that restarts faster than its probes miss is caught by its weight
version: once it held a version miles pushed (a number), a label miles never sends ("default",
SGLang's first) means a new process holding other weights, and it is taken out at once.
Non-goals: what happens to a dead engine (replacement.py); the fleet's state (fleet.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time

from miles.orchestration.fleet.engines import Slot
from miles.versions import is_miles_version

log = logging.getLogger(__name__)

_RESTARTED = "restarted"  # a probe's verdict that takes an engine out at once, whatever the threshold


class Probing:
    """EngineFleet's probing half: the monitor thread and the probe rounds (the state is EngineFleet's)."""

    def start_monitor(self) -> None:
        for _ in range(self.cfg.standby_engines):
            self._start_standby()
        if self.cfg.enabled and self._monitor is None:
            self._monitor = threading.Thread(target=self._monitor_main, name="miles-health", daemon=True)
            self._monitor.start()

    def _probe_slot(self, slot: Slot, url: str) -> str | None:
        """The liveness probe, and for a serving engine the run did not start, whether it was restarted
        meanwhile. None if alive, else why not."""
        err = self.liveness.generating(url)
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
        """The engine's weight version, or None when it cannot be read now."""
        return self._client.weight_version(url, self.cfg.timeout_s)

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
