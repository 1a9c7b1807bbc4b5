"""The weight-transport contract: how prepared buckets of full, engine-named tensors reach engines.

A transport is used once per weight version as
    connect(urls) once  ->  send_bucket(b) for every bucket  ->  commit(version)
and engines apply a version only at commit, all of it at once (DESIGN 4.4). A failed send_bucket
raises; the following commit() then refuses (raises) and discards that version on every engine, so
engines keep their previous weights, and the version after it starts clean.
Non-goals: gathering shards and renaming parameters (sync/prepare.py does that before the transport).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


class TransportError(RuntimeError):
    """A transfer or commit failed on at least one engine; the message names the engines."""


@runtime_checkable
class WeightTransport(Protocol):
    def connect(self, engine_urls: list[str]) -> None:
        """Set up the channel to every engine (e.g. join a process group); once per engine set."""

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Deliver (HF name, full tensor) pairs to every engine's staging; returns when all have them."""

    def commit(self, weight_version: int) -> None:
        """Make every engine switch atomically to everything staged since the last commit."""

    def close(self) -> None:
        """Release the channel; connect() may be called again afterwards."""
