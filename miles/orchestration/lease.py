"""A lease: something that outlives the driver on purpose (a detached engine) ends itself once no driver
has renewed it for `lease_s`, so a run nobody resumes does not hold a node's resources for good.

    driver: LeaseRenewer ── every lease_s / 4: renew() on each holder ──► holder's Lease.renew()
    holder: Lease watch thread ── no renewal for lease_s ─► on_expire() (stop serving, exit)

Non-goals: fencing a holder whose lease expired while its driver still lives (the driver's health
probes replace it like any dead engine).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class Lease:
    """Calls `on_expire` once, from a thread of its own, when `renew` has not been called for lease_s."""

    def __init__(self, lease_s: float, on_expire: Callable[[], None], check_every_s: float | None = None):
        self.lease_s = lease_s
        self._on_expire = on_expire
        self._last = time.monotonic()
        self._check_every_s = check_every_s or min(5.0, lease_s / 10)
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="miles-lease", daemon=True).start()

    def renew(self) -> None:
        self._last = time.monotonic()

    def cancel(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self._check_every_s):
            idle = time.monotonic() - self._last
            if idle >= self.lease_s:
                log.warning("lease not renewed for %.0fs (its driver is gone and no --resume adopted it): ending",
                            idle)
                self._on_expire()
                return


class LeaseRenewer:
    """Renews every holder `holders()` returns every lease_s / 4 from a thread of the driver; `renew_one`
    sends one holder its renewal (without waiting for it: a dead holder is the fleet's business)."""

    def __init__(self, lease_s: float, holders: Callable[[], list], renew_one: Callable[[object], None]):
        self._holders, self._renew_one = holders, renew_one
        self._every_s = lease_s / 4
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="miles-lease-renewer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            for holder in self._holders():
                try:
                    self._renew_one(holder)
                except Exception as exc:  # noqa: BLE001 - one holder gone must not stop the others' renewals
                    log.debug("renewing a lease failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
