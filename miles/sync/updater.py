"""WeightUpdater: the trainer's side of weight sync, start to finish, for one set of engines.

    connect(urls) once -> push(named_tensors, version) per update -> close()

push = [pause engines in place + noise-fill them, first update only] → prepare + bucket + transport
+ commit → verify (every tensor at the first update; one checksum per bucket afterwards) → continue. A verification
failure raises VerificationError naming the engines and tensors; it never passes silently.
Non-goals: gathering shards (the trainer backend yields full tensors), cadence (the loop decides).
"""

from __future__ import annotations

import json
import logging
import os
import time

from miles.sync import verify
from miles.sync.convert import get_converter
from miles.sync.engine_client import EngineClient
from miles.sync.prepare import MiB, Record, SyncConfig, push_weights
from miles.sync.transports import TRANSPORTS, TransportError

log = logging.getLogger(__name__)


class WeightUpdater:
    def __init__(self, cfg: SyncConfig, admin_token: str | None = None, base_path: str = "",
                 noise_seed: int = 0):
        cfg = cfg.resolved()
        self.cfg, self.admin_token, self.noise_seed = cfg, admin_token, noise_seed
        self.transport = TRANSPORTS.get(cfg.transport).from_config(cfg, admin_token, base_path)
        self.converter = get_converter(cfg.converter, _model_type(base_path))
        self.engine_urls: list[str] = []
        self._client = None
        self._updates = 0

    def connect(self, engine_urls: list[str]) -> None:
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.transport.connect(self.engine_urls)
        if self._client is not None:  # a reconnect to a changed set of engines
            self._client.close()
        self._client = EngineClient(self.admin_token, self.cfg.timeout_s)

    def push(self, named, version: int) -> dict[str, float]:
        if self._client is None:
            raise RuntimeError("push before connect: the trainer has no route to the engines")
        full_check = self._updates == 0 and self.cfg.verify_first_update
        record = Record(per_tensor=full_check) if full_check or self.cfg.verify_checksums else None
        if full_check:
            # Engines hold noise from the fill until the commit: hold their running requests between two
            # steps meanwhile (in-place pause), so that nothing is generated from noise.
            paused = self._pause()  # the engines this call paused (not those someone else had paused)
            try:
                # A tensor the transport never writes keeps this noise, so it cannot pass the comparison.
                verify.noise_fill(self._client, self.engine_urls, self.noise_seed)
                metrics = self._push(named, version, record)
                t0 = time.perf_counter()
                verify.compare_full(self._client, self.engine_urls, record.tensors)
            finally:
                if paused:
                    self._client.post_all(paused, "/continue_generation", {})
            metrics["sync/verified_tensors"] = len(record.tensors)
        else:
            metrics = self._push(named, version, record)
            t0 = time.perf_counter()
        if not full_check and record is not None:
            verify.compare_buckets(self._client, self.engine_urls, record.buckets, record.digests)
            metrics["sync/verified_buckets"] = len(record.buckets)
        metrics["sync/verify_s"] = time.perf_counter() - t0
        for k, v in getattr(self.transport, "last_stats", {}).items():
            metrics[f"sync/{k}"] = v
        return metrics

    def _push(self, named, version: int, record) -> dict[str, float]:
        metrics = push_weights(named, self.transport, version, self.cfg.bucket_size_mb * MiB, self.cfg.dtype,
                               converter=self.converter, record=record)
        self._updates += 1
        return metrics

    def _pause(self) -> list[str]:
        """Pause in place every engine that is generating; returns the URLs it paused."""
        paused = []
        for url in self.engine_urls:
            try:
                if self._client.get(url, "/get_load").get("paused"):
                    continue  # paused by its owner, who will also continue it
                self._client.post(url, "/pause_generation", {"mode": "in_place"})
                paused.append(url)
            except TransportError as exc:
                log.warning("engine %s could not be paused for the verified first update (%s); requests "
                            "running during it may see the noise fill", url, exc)
        return paused

    def close(self) -> None:
        self.transport.close()
        if self._client is not None:
            self._client.close()
        self._client = None


def _model_type(path: str) -> str | None:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None
