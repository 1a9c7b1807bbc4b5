"""Weight transports, chosen by name from TRANSPORTS (see base.py for the contract).

broadcast: one collective per bucket from the trainer's source to every engine.
p2p: each engine gets its own channel (shared memory on this host, point-to-point sends across hosts).
disk_delta: only the changed bytes, via files every host patches its local copy with.
disk: every version as a full checkpoint, loaded by SGLang's /update_weights_from_disk.
colocated: engines on the trainer's machine read buckets from shared memory the trainer hands over.

Each entry is one file holding its Sender, Receiver and Config; a user's transport is given as
`sync.transport = "mypkg.mod:MyTransport"`. Entries load on first use, so choosing one imports only it.
"""

from __future__ import annotations

from miles.registry import Registry
from miles.sync.transports.base import Transport, TransportError, TransportReceiver, WeightUpdateError

TRANSPORTS: Registry[type[Transport]] = Registry(
    "weight transport", protocol=Transport,
    hint=" (a class with Config, Receiver, from_config, connect, send_bucket, commit and close; see "
         "miles/sync/transports/base.py)")
TRANSPORTS.register("broadcast", "miles.sync.transports.broadcast:BroadcastTransport")
TRANSPORTS.register("p2p", "miles.sync.transports.p2p:P2PTransport")
TRANSPORTS.register("disk_delta", "miles.sync.transports.disk_delta:DiskDeltaTransport")
TRANSPORTS.register("colocated", "miles.sync.transports.colocated:ColocatedTransport")
TRANSPORTS.register("disk", "miles.sync.transports.disk:DiskTransport")


def get_transport(name: str, **kwargs) -> Transport:
    """Build the sender of the transport registered under `name` (or `module:Class`) from keywords."""
    return TRANSPORTS.get(name)(**kwargs)


__all__ = ["TRANSPORTS", "Transport", "TransportError", "TransportReceiver", "WeightUpdateError", "get_transport"]
