"""The transport contract: how prepared buckets of full, engine-named tensors reach engines.

A transport is one class, registered in TRANSPORTS (transports/__init__.py), whose instances are the
trainer's Sender. The class also carries its `Config` (a SyncConfig subclass with the transport's own
settings, chosen by `sync.transport`) and its `Receiver` (the engine's end: the routes and state this
transport adds to the engine's shared staging and commit, engine/weight_receiver.py). Every
built-in engine mounts the Receivers of the transports registered in TRANSPORTS; a user's transport
given as `module:Class` either rides on those routes (Receiver = None) or is registered in the
engine's process too. Adding a built-in transport is one file plus one TRANSPORTS line.

The sender is used once per weight version as
    connect(urls) once  ->  send_bucket(b) for every bucket  ->  commit(version)
and engines apply a version only at commit, all of it at once (DESIGN 4.4). A failed send_bucket
raises; the following commit() then refuses (raises) and discards that version on every engine, so
engines keep their previous weights, and the version after it starts clean.
Non-goals: gathering shards and renaming parameters (sync/prepare.py does that before the transport).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from miles.engine_api.client import EngineClient
from miles.engine_api.errors import EngineError, InvalidRequest

if TYPE_CHECKING:
    import torch


class TransportError(EngineError):
    """A transfer or commit failed on at least one engine; the message names the engines. Also what a
    transport's EngineClient raises for one call (`engine_client`), so callers catch one error."""


class WeightUpdateError(InvalidRequest):
    """A weight update the engine refused; the old weights stay in force (HTTP 400)."""


def engine_client(admin_token: str | None, timeout_s: float) -> EngineClient:
    """The client the trainer's end talks to engines with: its failures are TransportErrors."""
    return EngineClient(admin_token=admin_token, timeout_s=timeout_s, error=TransportError)


def reconnect(transport, engine_urls: list[str], timeout_s: float) -> EngineClient:
    """How an HTTP transport's `connect` begins: refuse an empty engine list, close what an earlier
    connect opened, keep the URLs (no trailing slash) as `transport.engine_urls`, and return a fresh
    client carrying the transport's admin token."""
    if not engine_urls:
        raise ValueError("connect: no engine URLs given")
    transport.close()
    transport.engine_urls = [u.rstrip("/") for u in engine_urls]
    return engine_client(transport.admin_token, timeout_s)


class Transport(Protocol):
    """A transport class (its instances are the trainer's Sender)."""

    Config: ClassVar[type]
    """The run config's `sync` table when this transport is chosen: miles.sync.prepare.SyncConfig or a
    dataclass subclassing it (with the transport's own settings)."""
    Receiver: ClassVar[type[TransportReceiver] | None]
    """The engine's end (routes + state); None when it rides on another transport's routes."""
    supports_colocation: ClassVar[bool]
    """Whether it may run with placement.mode = 'colocated'."""
    supports_lora: ClassVar[bool]
    """Whether it can ship a LoRA run's merged weights."""
    supports_pd_disaggregation: ClassVar[bool]
    """Whether it can update prefill/decode-disaggregated engines."""

    def from_config(self, cfg: Any, admin_token: str | None, base_path: str) -> Transport:
        """(A classmethod.) The sender for a run: `cfg` is this transport's Config (a SyncConfig),
        `base_path` the run's starting checkpoint."""

    def connect(self, engine_urls: list[str]) -> None:
        """Set up the channel to every engine (e.g. join a process group); once per engine set."""

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Deliver (HF name, full tensor) pairs to every engine's staging; returns when all have them."""

    def commit(self, weight_version: int) -> None:
        """Make every engine switch atomically to everything staged since the last commit."""

    def close(self) -> None:
        """Release the channel; connect() may be called again afterwards."""


class TransportReceiver:
    """The engine's end of one transport, built once per engine around its WeightReceiver.

    It stages through `weights` (the receiver every transport shares: staging, commit, verification)
    and adds its own routes in `mount`. The hooks below let the shared commit reach the state a
    transport keeps between versions; each defaults to "nothing of mine".
    """

    extension: ClassVar[str | None] = None
    """The miles extension this end adds to the engine (advertised in /get_server_info as one of
    `miles_extensions`), or None when it only serves SGLang's own routes. An engine in SGLang-only
    mode builds no Receiver that has one."""

    def __init__(self, weights: Any):
        self.weights = weights

    def mount(self, api: Any) -> None:
        """Add this transport's routes to `api.router` (a weight_api.WeightRoutes)."""

    def lent(self, path: str) -> torch.Tensor | None:
        """The shared-memory buffer at `path` if this transport lent it to a sender (the engine owns it)."""
        return None

    def write_next(self, path: str) -> str | None:
        """Where a sender that committed from lent buffer `path` writes its next version."""
        return None

    def committed(self, adopted: str | None) -> None:
        """A version was applied (under the receiver's lock); `adopted`: the lent buffer it now lives in."""

    def discarded(self) -> None:
        """Staging was discarded (reset or a refused bucket); drop what was pending with it."""

    def close(self) -> None:
        """The engine is shutting down: free what this transport holds."""
