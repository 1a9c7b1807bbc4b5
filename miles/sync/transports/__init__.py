"""Weight transports, chosen by name from TRANSPORTS (see base.py for the contract)."""

from __future__ import annotations

from miles.sync.transports.base import TransportError, WeightTransport
from miles.sync.transports.broadcast import BroadcastTransport

TRANSPORTS: dict[str, type] = {"broadcast": BroadcastTransport}


def get_transport(name: str, **kwargs) -> WeightTransport:
    """Build the transport registered under `name` with its keyword config."""
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown weight transport {name!r}: choose one of {sorted(TRANSPORTS)}") from None
    return cls(**kwargs)


__all__ = ["TRANSPORTS", "BroadcastTransport", "TransportError", "WeightTransport", "get_transport"]
