"""The engine fleet of `miles train`: the engines of a run, watched and kept serving.

    fleet.py        EngineFleet: membership, weight pushes against the serving set, router calls, report
    probing.py      the health monitor: probe rounds, misses, restarted external engines
    replacement.py  a dead engine replaced (or routed around and re-admitted), standbys, admission
    engines.py      EngineHandle, Slot, Replacement: one engine and what became of it

When an engine counts as dead is the run's one liveness section and checker (miles/rollout/liveness.py).
"""

from miles.orchestration.fleet.engines import EngineHandle, FleetError, Replacement, Slot
from miles.orchestration.fleet.fleet import EngineFleet

__all__ = ["EngineFleet", "EngineHandle", "FleetError", "Replacement", "Slot"]
