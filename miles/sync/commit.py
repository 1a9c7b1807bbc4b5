"""The fleet-wide commit round of a weight push: all engines move to the version, or the ones that did
not acknowledge are fenced.

The commit is one fleet-wide round in two phases (`FleetCommit.run`). Phase one is the transport's
sends: every engine stages and checks every bucket, or the version fails with nothing committed.
Then every engine is held between two decode steps (in-place pause) and must answer: its
acknowledgement. Phase two sends the commit to all, and engines generate again only once every one
acknowledged its commit (within sync.timeout_s): no engine serves the new version while another
still serves the old one. An engine that does not acknowledge in time while others moved is fenced:
it stays held (it serves nothing, at whatever version it ends up), the attempt raises
FencedEngines naming it, and the fleet (orchestration/fleet/) takes it out of routing and replaces
it or catches it up with a full push before it serves again.
Non-goals: sending the version's buckets (the transports), deciding what replaces a fenced engine
(orchestration/fleet/).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from miles.sync.transports import TransportError
from miles.sync.transports.base import engine_client
from miles.versions import to_wire

log = logging.getLogger(__name__)


class FencedEngines(TransportError):
    """A commit round in which some engines committed the version and `fenced` (URLs) did not acknowledge
    their commit in time: the fleet is at `version` without them. They are held (paused in place), so
    they serve nothing at their old version; they must leave routing and be replaced or brought to the
    version by a full push before they serve again. Set as attributes, so that the error pickles (Ray)."""

    version: int | None = None
    fenced: tuple[str, ...] = ()


@dataclasses.dataclass
class CommitRound:
    """One fleet-wide commit round, as `WeightUpdater.rounds` keeps it (time.time() seconds): no engine
    generated between held_at and released_at; from released_at on, every engine serving holds `version`."""

    version: int
    held_at: float
    released_at: float
    fenced: tuple[str, ...] = ()


class FleetCommit:
    """The commit rounds of one WeightUpdater (`u`: its engines, extensions, token and sync config)."""

    def __init__(self, updater):
        self.u = updater
        self.at_commit = None  # stall_before_commit's function, until the next commit round takes it
        self.fenced: set[str] = set()  # engines the current attempt's commit round fenced: never continued
        self.committing = threading.Event()  # a commit round is under way (the attempt deadline waits for it)
        self.rounds: list[CommitRound] = []  # committed versions, newest last (the last 100)

    def run(self, transport, version: int) -> None:
        """Commit `version` on every engine, all or fenced (see the module's docstring)."""
        self.committing.set()
        held: list[str] = []
        fenced: list[str] = []
        held_at = time.time()
        try:
            held = self._hold()
            # Taken once every engine answered its pause: a request sent before then may still have been
            # generating at the old version.
            held_at = time.time()
            if self.at_commit is not None:
                stall, self.at_commit = self.at_commit, None
                stall()
            done, box = threading.Event(), {}

            def run():
                try:
                    transport.commit(version)
                except BaseException as exc:  # noqa: BLE001 - handed to the round below
                    box["error"] = exc
                finally:
                    done.set()

            threading.Thread(target=run, name="miles-commit", daemon=True).start()
            if not done.wait(self.u.cfg.timeout_s):
                box["error"] = TransportError(f"not every engine acknowledged the commit of weight version "
                                              f"{version} within sync.timeout_s = {self.u.cfg.timeout_s}s")
            error = box.get("error")
            if error is not None:
                moved, behind, silent = self._versions_after(version)
                # Once any engine moved, every other one is fenced; while commits may still land (the round
                # timed out), so is every engine that does not answer.
                fenced = behind + silent if moved else ([] if done.is_set() else silent)
                if not fenced:
                    raise error
                self.fenced = set(fenced)
                log.error("weight version %d: %s did not acknowledge the commit in time (%s); the fleet moves to "
                          "it without them: they stay held until replaced or caught up", version, fenced, error)
                exc = FencedEngines(f"weight version {version} was committed on {moved} but not acknowledged in "
                                    f"time by {fenced}, which are fenced (held, serving nothing) until they are "
                                    f"replaced or caught up: {error}")
                exc.version, exc.fenced = version, tuple(fenced)
                raise exc from None
        finally:
            self._release([u for u in held if u not in fenced])
            self.committing.clear()
            if fenced:  # the fleet moved to the version without them
                self.rounds = [*self.rounds[-99:], CommitRound(version, held_at, time.time(), tuple(fenced))]
        self.rounds = [*self.rounds[-99:], CommitRound(version, held_at, time.time())]

    def _hold(self) -> list[str]:
        """Pause in place every engine that is generating, all at once; every engine must answer (its
        acknowledgement that it is alive, holding the version staged). Returns the engines this paused
        (not those their owner had paused). Without the engine_load extension: only the readiness check."""
        if "engine_load" not in self.u.extensions:
            self._ready()
            return []
        quick = engine_client(self.u.admin_token, min(self.u.cfg.timeout_s, 10.0))
        try:
            try:
                loads = quick.post_all(self.u.engine_urls, "/get_load", None, method="GET")
            except TransportError as exc:
                raise TransportError(f"not committing: an engine is not answering ({exc})") from None
            free = [u for u, load in zip(self.u.engine_urls, loads) if not load.get("paused")]
            answers = quick.try_all(free, "/pause_generation", {"mode": "in_place"})
            held = [u for u, a in zip(free, answers) if not isinstance(a, BaseException)]
            failed = [a for a in answers if isinstance(a, BaseException)]
        finally:
            quick.close()
        if failed:
            self._release(held)
            raise TransportError("not committing: an engine is not answering (" + "; ".join(map(str, failed)) + ")")
        return held

    def _release(self, urls: list[str]) -> None:
        if not urls:
            return
        quick = engine_client(self.u.admin_token, min(self.u.cfg.timeout_s, 10.0))
        try:
            for url, a in zip(urls, quick.try_all(urls, "/continue_generation", {})):
                if isinstance(a, BaseException):
                    log.warning("engine %s held for a commit round could not be continued (%s)", url, a)
        finally:
            quick.close()

    def _versions_after(self, version: int) -> tuple[list[str], list[str], list[str]]:
        """After a failed commit round: the engines holding `version`, those at another, those not answering."""
        want = to_wire(version)
        quick = engine_client(self.u.admin_token, min(self.u.cfg.timeout_s, 10.0))
        try:
            seen = quick.run_all([lambda u=u: quick.weight_version(u, min(self.u.cfg.timeout_s, 10.0))
                                  for u in self.u.engine_urls])
        finally:
            quick.close()
        moved = [u for u, v in zip(self.u.engine_urls, seen) if v is not None and str(v) == want]
        behind = [u for u, v in zip(self.u.engine_urls, seen) if v is not None and str(v) != want]
        silent = [u for u, v in zip(self.u.engine_urls, seen) if v is None]
        return moved, behind, silent

    def _ready(self) -> None:
        """Before any engine commits: every engine must answer at once. An engine that stalls (a stopped
        process, a wedged host) fails the version here, while no engine has committed it, instead of
        leaving the fleet on two versions."""
        quick = engine_client(self.u.admin_token, min(self.u.cfg.timeout_s, 10.0))
        try:
            quick.post_all(self.u.engine_urls, "/health", None, method="GET")
        except TransportError as exc:
            raise TransportError(f"not committing: an engine is not answering ({exc})") from None
        finally:
            quick.close()


class CommittingTransport:
    """A transport whose commit is the fleet-wide commit round (FleetCommit.run)."""

    def __init__(self, inner, commit_round):
        self._inner, self._commit_round = inner, commit_round

    def send_bucket(self, bucket) -> None:
        self._inner.send_bucket(bucket)

    def commit(self, weight_version: int) -> None:
        self._commit_round(self._inner, weight_version)

    def __getattr__(self, name):
        return getattr(self._inner, name)
