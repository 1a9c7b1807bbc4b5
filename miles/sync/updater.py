"""WeightUpdater: the trainer's side of weight sync, start to finish, for one set of engines.

    connect(urls) once -> push(named_tensors, version) per update -> close()

push = [pause engines in place + noise-fill them, first update only] → prepare + bucket + transport
+ commit → verify (every tensor at the first update; one checksum per bucket afterwards) → continue. A verification
failure raises VerificationError naming the engines and tensors; it never passes silently.

The commit is one fleet-wide round in two phases, all engines or a fence (sync/commit.py).

Against engines without miles' extensions (plain SGLang servers, or built-in engines in SGLang-only
mode; see engine_api/extensions.py) only SGLang's protocol is used:
  * a transport whose engine end is an extension (p2p, disk_delta, colocated) is refused at connect,
    before the run starts, naming the transport that works (broadcast);
  * there is no staged commit, so every push is wrapped in /pause_generation (retract) and
    /continue_generation: no request decodes while the version is partly applied;
  * a push that fails midway is rolled back where the previous version still exists in full: the
    `disk` transport keeps its directory until every engine loaded the next, so every engine loads it
    again and serves it (`_recover_plain`). Over broadcast SGLang applies each bucket as it arrives and
    nothing of the previous version is kept (keeping a copy would cost every push a model's worth of
    host memory), so the push stops with MixedVersions: the engines stay paused and the error names
    the version each one reports;
  * verification uses SGLang's /weights_checker actions: once, before the run (`check_start`), the
    engines snapshot their weights, fill them with noise, receive the trainer's starting weights
    and compare with the snapshot, so a tensor the transport never writes fails by name; after each
    later update every engine's checksum must agree (SGLang's checksums cannot be recomputed by the
    trainer, so they are compared across engines). Live SGLang servers on the CPU are the exception:
    their checksums are SHA-256 of each parameter's bytes, which the trainer recomputes from what it
    sent (sglang_checksums.py), so every push is compared with the trainer's own tensors, and the
    start check noise-fills and compares those (SGLang's `compare` needs CUDA).
Non-goals: gathering shards (the trainer backend yields full tensors), cadence (the loop decides).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import threading
import time

from miles.precision.types import get_format
from miles.sync import sglang_checksums, verify
from miles.sync.commit import CommitRound, CommittingTransport, FencedEngines, FleetCommit
from miles.sync.convert import get_converter
from miles.sync.prepare import MiB, Record, SyncConfig, push_weights
from miles.sync.transports import TRANSPORTS, TransportError
from miles.sync.transports.base import engine_client
from miles.versions import INITIAL

log = logging.getLogger(__name__)


class WeightUpdater:
    def __init__(self, cfg: SyncConfig, admin_token: str | None = None, base_path: str = "",
                 noise_seed: int = 0):
        cfg = cfg.resolved()
        self.cfg, self.admin_token, self.noise_seed, self.base_path = cfg, admin_token, noise_seed, base_path
        self._abandoned: list[threading.Thread] = []  # attempts given up on at their deadline
        self._disconnected = True  # self.transport has no channel yet (before connect, after a rollback)
        self.transport = TRANSPORTS.get(cfg.transport).from_config(cfg, admin_token, base_path)
        self.converter = get_converter(cfg.converter, _model_type(base_path))
        self.engine_urls: list[str] = []
        self._client = None
        self._updates = 0
        self.extensions: frozenset[str] = frozenset()  # the miles extensions every engine offers
        self.started_checked = False  # check_start has verified the transport on these engines
        self._fresh_engines = False  # every engine reported SGLang's initial version at connect
        self._sglang_cpu = False  # every engine is a live SGLang on the CPU: its checksums can be recomputed
        self._engine_dtype = None  # their parameter dtype, what the recomputed checksums hash
        self.quantized: dict = {}  # engine name -> Format of weights sent as their format's bytes (wire.py)
        self._tamper = None  # tamper_next_version's function, until the next attempt takes it
        self.commits = FleetCommit(self)  # the fleet-wide commit rounds, and what they fenced

    @property
    def rounds(self) -> list[CommitRound]:
        """The committed versions' rounds, newest last (the last 100)."""
        return self.commits.rounds

    @property
    def plain(self) -> bool:
        """Whether the engines speak only SGLang's protocol (no staged commit)."""
        return "staged_commit" not in self.extensions

    @property
    def takes_device_tensors(self) -> bool:
        """Whether the transport in use takes tensors on the trainer's GPU (it hands device memory over)."""
        return bool(getattr(self.transport, "takes_device_tensors", False))

    def relabel(self, version: int) -> None:
        """Label every engine's weights as `version` (SGLang's /update_weight_version), without moving
        them: a run that goes back to a checkpoint pushes an older number than the engines hold, and
        a commit never moves an engine's version backwards."""
        self._client.post_all(self.engine_urls, "/update_weight_version", {"new_version": str(version)})

    def connect(self, engine_urls: list[str]) -> None:
        urls = [u.rstrip("/") for u in engine_urls]
        if self._client is not None:  # a reconnect to a changed set of engines
            self._client.close()
        self._client = engine_client(self.admin_token, self.cfg.timeout_s)
        self.extensions = self._client.extensions(urls)
        receiver = getattr(self.transport, "Receiver", None)
        needed = getattr(receiver, "extension", None)
        if needed is not None and needed not in self.extensions:
            raise TransportError(
                f"sync.transport = {self.cfg.transport!r} needs the miles extension {needed!r} on every engine, and "
                f"not every engine of {urls} advertises it (a plain SGLang server, or a built-in engine started "
                "with sglang_only, has no miles extensions): use sync.transport = 'broadcast', which runs on "
                "SGLang's own /update_weights_from_distributed")
        self.engine_urls = urls
        self.quantized = self._quantized_weights(urls)
        self.transport.connect(self.engine_urls)
        self._disconnected = False
        if self.plain:
            infos = self._client.post_all(urls, "/get_model_info", None, method="GET")
            self._fresh_engines = all(i.get("weight_version") == INITIAL for i in infos)
            servers = self._client.post_all(urls, "/get_server_info", None, method="GET")
            self._sglang_cpu = sglang_checksums.applies(servers)
            self._engine_dtype = sglang_checksums.engine_dtype(servers)

    def _quantized_weights(self, urls: list[str]) -> dict:
        """The weights to send quantized: those every engine serves in the same format (the
        `quantized_weights` extension), unless sync.quantized_wire is off. Engines that disagree get
        full precision, which every engine accepts (it then quantizes what it received)."""
        if not self.cfg.quantized_wire or "quantized_weights" not in self.extensions:
            return {}
        tables = [i.get("quantized_weights") or {} for i in
                  self._client.post_all(urls, "/get_server_info", None, method="GET")]
        if any(t != tables[0] for t in tables[1:]):
            log.warning("engines %s serve different weights or formats: weights travel in full precision", urls)
            return {}
        return {name: get_format(fmt) for name, fmt in tables[0].items()}

    def channels(self) -> dict[str, str]:
        """How weights reach each engine (e.g. "p2p shm", "p2p tcp via ADDRESS"), as the transport says,
        else the transport's name."""
        said = getattr(self.transport, "channels", None)
        return said() if said is not None else {url: self.cfg.transport for url in self.engine_urls}

    @property
    def needs_start_check(self) -> bool:
        """Whether verification on these engines needs `check_start` before the first update: only
        while every engine still holds the weights it was launched with (version "default"), which
        for a new run are the trainer's starting weights. Engines a resumed or restarted trainer
        finds at a later version hold weights the trainer cannot reproduce at connect."""
        return self.plain and self.cfg.verify_first_update and not self.started_checked and self._fresh_engines

    def check_start(self, named) -> dict[str, float]:
        """SGLang's verification flow, once before the run, with the trainer's starting weights (which
        the engines also hold): fill with noise, push, compare. A tensor the transport never writes
        still holds noise, and is named. The comparison is SGLang's own (`compare` against a snapshot
        taken first) or, on live SGLang servers on the CPU, whose `compare` needs CUDA, every engine
        tensor's checksum against the one the trainer computes from what it sent (sglang_checksums.py)."""
        t0 = time.perf_counter()
        record = sglang_checksums.SGLangChecksums(self._engine_dtype) if self._sglang_cpu else None
        paused = self._pause_plain()
        try:
            if record is None:
                self._client.post_all(self.engine_urls, "/weights_checker", {"action": "snapshot"})
            self._client.post_all(self.engine_urls, "/weights_checker", {"action": "reset_tensors"})
            metrics = push_weights(named, self.transport, 0, self.cfg.bucket_size_mb * MiB, self.cfg.dtype,
                                   converter=self.converter, record=record)
            if record is not None:
                metrics["sync/verified_tensors"] = record.compare(self._client, self.engine_urls)
            else:
                try:
                    self._client.post_all(self.engine_urls, "/weights_checker", {"action": "compare"})
                except TransportError as exc:
                    raise verify.VerificationError(f"an engine's weights differ from its snapshot ({exc})") from None
        except verify.VerificationError as exc:
            raise verify.VerificationError(f"weight verification failed: after the noise fill and a push of the "
                                           f"trainer's starting weights, {exc}") from None
        finally:
            self._continue(paused)
        self.started_checked = True
        log.info("verified %s on %d engine(s)%s", self.cfg.transport, len(self.engine_urls),
                 " against the trainer's checksums" if record is not None else " over SGLang's weights_checker")
        return {**metrics, "sync/start_check_s": time.perf_counter() - t0}

    def push(self, named, version: int) -> dict[str, float]:
        """Push one version. Each attempt has a deadline (sync.version_timeout_s; each bucket has
        sync.timeout_s); a failed or timed-out attempt is rolled back on every engine (staging discarded,
        nothing committed) and retried, sync.retries more times over this transport, then over each
        transport of sync.fallback in turn. Raises TransportError once every attempt has failed."""
        if self._client is None:
            raise RuntimeError("push before connect: the trainer has no route to the engines")
        if self.plain:
            return self._push_plain(named, version)
        plan = [name for name in [self.cfg.transport, *self.cfg.fallback] for _ in range(self.cfg.retries + 1)]
        source = _Replay(named) if len(plan) > 1 else None
        rollbacks = fallbacks = 0
        errors = []
        for attempt, name in enumerate(plan):
            if attempt and name != plan[attempt - 1]:
                fallbacks += 1
                log.warning("weight version %d: moving from sync.transport %r to fallback %r", version,
                            plan[attempt - 1], name)
            try:
                metrics = self._attempt(name, source.view() if source else named, version,
                                        fresh=attempt > 0 or self._disconnected)
            except FencedEngines:
                # The fleet moved without them: trying again here would wait on them again. The sender
                # stopped mid-commit, so the next push starts from a fresh one; nothing is left staged.
                self._rollback(version, reset=False)
                raise
            except TransportError as exc:
                last = exc
                errors.append(f"attempt {attempt + 1} over {name}: {exc}")
                rollbacks += 1
                self._rollback(version)
                continue
            metrics["sync/rollbacks"], metrics["sync/fallbacks"] = rollbacks, fallbacks
            if name != self.cfg.transport:
                metrics["sync/fell_back"] = 1
            return metrics
        # The last attempt's kind (a VerificationError stays one), with every attempt's reason.
        raise type(last)(f"weight version {version} failed on every attempt: " + " | ".join(errors))

    def tamper_next_version(self, damage) -> bool:
        """Fault injection: `damage(paths)` runs once, on the files of the next attempt's version after
        they are written and before any engine reads them, to show that verification refuses them and
        the version is rolled back and retried. False when the transport writes no files (only
        transports with an `after_write` hook, disk_delta, do)."""
        if not hasattr(TRANSPORTS.get(self.cfg.transport), "after_write"):
            return False
        self._tamper = damage
        return True

    def stall_before_commit(self, stall) -> None:
        """Fault injection (fault.stall_engine_at_commit): `stall()` runs once, in the next commit round,
        after every engine acknowledged it holds the version staged and right before the commit is sent."""
        self.commits.at_commit = stall

    def _attempt(self, name: str, named, version: int, fresh: bool) -> dict[str, float]:
        """One push of the version over transport `name` (a fresh sender after a failure), run on a
        thread so that a stalled transport costs at most sync.version_timeout_s."""
        result: dict = {}

        def run():
            try:
                if fresh:
                    self.transport = self._build(name)
                    self.transport.connect(self.engine_urls)
                    self._disconnected = False
                if self._tamper is not None and hasattr(self.transport, "after_write"):
                    self.transport.after_write, self._tamper = self._tamper, None
                result["metrics"] = self._push_checked(named, version)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                result["error"] = exc

        self.commits.fenced = set()
        worker = threading.Thread(target=run, name="miles-weight-push", daemon=True)
        worker.start()
        worker.join(self.cfg.version_timeout_s)
        if worker.is_alive() and self.commits.committing.is_set():
            # A commit round is not cut short (engines may have committed): it ends within its own deadline.
            worker.join(self.cfg.timeout_s + 30.0)
        if worker.is_alive():
            self._abandoned.append(worker)  # stuck in a transport call; its sender is dropped below
            raise TransportError(f"the version did not reach every engine within sync.version_timeout_s = "
                                 f"{self.cfg.version_timeout_s}s")
        if "error" in result:
            exc = result["error"]
            if isinstance(exc, TransportError):
                raise exc
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        return result["metrics"]

    def _build(self, name: str):
        cfg = dataclasses.replace(self.cfg, transport=name).resolved()
        if name == "disk" and not getattr(cfg, "disk_dir", ""):
            cfg = dataclasses.replace(cfg, disk_dir=tempfile.mkdtemp(prefix="miles-sync-fallback-"))
        return TRANSPORTS.get(name).from_config(cfg, self.admin_token, self.base_path)

    def _rollback(self, version: int, reset: bool = True) -> None:
        """Discard whatever the failed attempt staged on every engine that answers (unless not `reset`),
        and drop its sender (closing it on a thread of its own: a stalled channel may never answer)."""
        failed, self._disconnected = self.transport, True
        self.transport = self._build(self.cfg.transport)  # unconnected: the next attempt connects its own
        threading.Thread(target=_close_quietly, args=(failed,), daemon=True).start()
        if not reset:
            return
        quick = engine_client(self.admin_token, min(self.cfg.timeout_s, 10.0))
        try:
            quick.post_all(self.engine_urls, "/update_weights_from_disk", {"reset_staging": True})
        except TransportError as exc:
            log.warning("weight version %d rolled back; some engines did not answer the rollback (%s): they "
                        "hold nothing committed, and their staging is discarded by the next attempt", version, exc)
        finally:
            quick.close()

    def _push_checked(self, named, version: int) -> dict[str, float]:
        full_check = self._updates == 0 and self.cfg.verify_first_update
        # Weights handed over in GPU memory are checksummed there, when every engine can do the same.
        digest = "sum64" if self.takes_device_tensors and "device_digest" in self.extensions else "xxh3"
        record = Record(per_tensor=full_check, digest=digest) if full_check or self.cfg.verify_checksums else None
        if full_check:
            # Engines hold noise from the fill until the commit: hold their running requests between two
            # steps meanwhile (in-place pause), so that nothing is generated from noise.
            paused = self._pause()  # the engines this call paused (not those someone else had paused)
            try:
                # A tensor the transport never writes keeps this noise, so it cannot pass the comparison.
                verify.noise_fill(self._client, self.engine_urls, self.noise_seed)
                metrics = self._push(named, version, record)
                t0 = time.perf_counter()
                verify.compare_full(self._client, self.engine_urls, record.tensors, record.digest)
            finally:
                paused = [u for u in paused if u not in self.commits.fenced]
                if paused:
                    self._client.post_all(paused, "/continue_generation", {})
            metrics["sync/verified_tensors"] = len(record.tensors)
        else:
            metrics = self._push(named, version, record)
            t0 = time.perf_counter()
        if not full_check and record is not None:
            verify.compare_buckets(self._client, self.engine_urls, record.buckets, record.digests, record.digest)
            metrics["sync/verified_buckets"] = len(record.buckets)
        metrics["sync/verify_s"] = time.perf_counter() - t0
        for k, v in getattr(self.transport, "last_stats", {}).items():
            metrics[f"sync/{k}"] = v
        self._updates += 1  # only a verified version counts: a retry of a failed first one is noise-checked again
        return metrics

    def _push(self, named, version: int, record) -> dict[str, float]:
        transport = self.transport if self.plain else CommittingTransport(self.transport, self.commits.run)
        metrics = push_weights(named, transport, version, self.cfg.bucket_size_mb * MiB, self.cfg.dtype,
                               converter=self.converter, record=record,
                               quantized=None if self.plain else self.quantized)
        return metrics

    def _push_plain(self, named, version: int) -> dict[str, float]:
        """A push to engines without a staged commit: paused (retract) from the first bucket to the
        version label, so no request decodes from a partly applied version. A failure is rolled back
        or reported engine by engine (`_recover_plain`); either way it raises."""
        recomputed = self.cfg.verify_checksums and self._sglang_cpu
        record = sglang_checksums.SGLangChecksums(self._engine_dtype) if recomputed else None
        paused = self._pause_plain()
        try:
            metrics = self._push(named, version, record)
        except TransportError as exc:
            self._recover_plain(version, exc)
        t0 = time.perf_counter()
        try:
            if recomputed:  # against the trainer's own tensors
                metrics["sync/verified_tensors"] = record.compare(self._client, self.engine_urls)
                metrics["sync/verified_engines"] = len(self.engine_urls)
            elif self.cfg.verify_checksums:
                verify.compare_across_engines(self._client, self.engine_urls)
                metrics["sync/verified_engines"] = len(self.engine_urls)
        finally:
            self._continue(paused)
        self._updates += 1
        metrics["sync/verify_s"] = time.perf_counter() - t0
        return metrics

    def _recover_plain(self, version: int, exc: TransportError) -> None:
        """After a failed push to SGLang engines: load the previous version again on every engine and
        continue them, then raise saying so; where that cannot be done (no copy of it left, or an engine
        did not take it), raise MixedVersions naming the version each engine reports, leaving every engine
        paused, since some may hold part of `version` under the previous label."""
        restore = getattr(self.transport, "restore", None)
        why = (f"sync.transport = {self.cfg.transport!r} keeps no copy of the previous version to roll back to "
               "(sync.transport = 'disk' does)")
        if restore is not None:
            try:
                restored = restore(self.engine_urls)
                why = "this sender has loaded no version yet, so there is none to roll back to"
            except TransportError as rexc:
                restored, why = None, f"rolling back failed: {rexc}"
            if restored is not None:
                previous, source = restored
                try:
                    if self.cfg.verify_checksums:
                        verify.compare_across_engines(self._client, self.engine_urls)
                    self._continue(self.engine_urls)
                except TransportError as rexc:
                    why = f"after rolling back to version {previous}: {rexc}"
                else:
                    log.warning("weight version %d failed; every engine was rolled back to version %d", version,
                                previous)
                    raise TransportError(
                        f"weight version {version} failed ({exc}); every engine was rolled back to version "
                        f"{previous} (reloaded from {source}) and serves it") from None
        held = self._versions_held()
        raise MixedVersions(
            f"weight version {version} failed midway ({exc}); {why}. SGLang applies each part of a version as it "
            f"arrives, so an engine may hold part of version {version} under an older label: every engine stays "
            "paused (nothing is generated from a mixture) until a push succeeds, and since each push to SGLang "
            "engines sends every tensor, the next one that succeeds brings every engine it reaches to one version. "
            "Versions the engines report: " + ", ".join(f"{url}: {label}" for url, label in held.items()),
            held) from None

    def _versions_held(self) -> dict[str, str]:
        """Each engine's weight version label, as SGLang's /get_model_info reports it ("no answer: ..." when
        the engine did not answer)."""
        held = {}
        for url in self.engine_urls:
            try:
                held[url] = str(self._client.get(url, "/get_model_info").get("weight_version"))
            except TransportError as exc:
                held[url] = f"no answer ({exc})"
        return held

    def _pause_plain(self) -> list[str]:
        # retract, not in_place: SGLang flushes the KV cache after an update, which it refuses while
        # requests sit in the running batch; retracted ones recompute their KV under the new weights.
        self._client.post_all(self.engine_urls, "/pause_generation", {"mode": "retract"})
        return list(self.engine_urls)

    def _continue(self, urls: list[str]) -> None:
        if urls:
            self._client.post_all(urls, "/continue_generation", {})

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


class MixedVersions(TransportError):
    """A push to SGLang engines failed midway and could not be rolled back: `held` maps each engine to
    the version label it reports (its weights may include part of the failed version). Set as an
    instance attribute, so that the error pickles (Ray)."""

    def __init__(self, message: str, held: dict[str, str] | None = None):
        super().__init__(message)
        self.held = dict(held or {})


class _Replay:
    """A version's (name, tensor) pairs, kept as the first attempt draws them, so that a retry sends the
    same tensors again (the trainer's gather runs once). Only the newest view draws: an attempt given
    up on at its deadline that wakes later gets nothing more."""

    def __init__(self, named):
        self._source, self._seen, self._lock, self._current = iter(named), [], threading.Lock(), 0

    def view(self):
        with self._lock:
            self._current += 1
            mine = self._current
        i = 0
        while True:
            with self._lock:
                if mine != self._current:  # fail the stale attempt rather than let it commit a part
                    raise TransportError("this attempt was given up on at its deadline; a newer one sends the version")
                if i == len(self._seen):
                    item = next(self._source, None)
                    if item is None:
                        return
                    self._seen.append(item)
                item = self._seen[i]
            i += 1
            yield item


def _close_quietly(transport) -> None:
    try:
        transport.close()
    except Exception as exc:  # noqa: BLE001 - a failed channel may fail to close too
        log.debug("closing a failed weight transport: %s", exc)
