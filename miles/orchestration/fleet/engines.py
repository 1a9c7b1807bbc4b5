"""The fleet's records: one running engine (EngineHandle), the place it serves in (Slot), and what
became of an engine declared dead (Replacement).

A dead engine on the driver's node is SIGKILLed by pid (which also ends a stopped process); one on
another node is ended through its stop callback (Ray kills the actor there). Engines started outside
the run (rollout.engine_urls) are never killed, stopped or restarted by it.
Non-goals: deciding an engine is dead (probing.py, rollout/liveness.py) and replacing it (replacement.py).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Callable

from miles.sync import shm

log = logging.getLogger(__name__)


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
