"""Weight transports, chosen by name from TRANSPORTS (see base.py for the contract).

broadcast: one collective per bucket from the trainer's source to every engine.
p2p: each engine gets its own channel (shared memory on this host, point-to-point sends across hosts).
disk_delta: only the changed bytes, via files every host patches its local copy with.
colocated: engines on the trainer's machine read buckets from shared memory the trainer hands over.
"""

from __future__ import annotations

from miles.sync.transports.base import TransportError, WeightTransport
from miles.sync.transports.broadcast import BroadcastTransport
from miles.sync.transports.colocated import ColocatedTransport
from miles.sync.transports.disk_delta import DiskDeltaTransport
from miles.sync.transports.p2p import P2PTransport

TRANSPORTS: dict[str, type] = {"broadcast": BroadcastTransport, "p2p": P2PTransport,
                               "disk_delta": DiskDeltaTransport, "colocated": ColocatedTransport}


def get_transport(name: str, **kwargs) -> WeightTransport:
    """Build the transport registered under `name` with its keyword config."""
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown weight transport {name!r}: choose one of {sorted(TRANSPORTS)}") from None
    return cls(**kwargs)


__all__ = ["TRANSPORTS", "BroadcastTransport", "ColocatedTransport", "DiskDeltaTransport", "P2PTransport",
           "TransportError", "WeightTransport", "get_transport"]
