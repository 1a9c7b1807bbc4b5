"""Broadcast transport: one torch.distributed group of the trainer's source (rank 0) + every engine.

Per bucket: the metadata (names, dtypes, shapes, load_format, commit=false) is POSTed to every
engine's /update_weights_from_distributed, then the bytes follow from rank 0, in one of the wire
formats of broadcast_wire.py ("flattened_small", the default: small tensors flattened together,
large ones alone). The sender flattens into a buffer it keeps, one message while gloo sends the one
before. Engines reply only after their receive completes, so collecting the replies is also the
barrier.

Against engines without miles' `staged_commit` extension (plain SGLang servers) each bucket is one
SGLang request that applies what it carries (load_format "flattened_bucket", flush_cache false), and
commit() labels the version (/update_weight_version) and flushes the cache (/flush_cache); the
updater pauses the engines around the whole push, since SGLang has no staging. SGLang 0.5.23 takes
/update_weights_from_distributed only inside a weight-update session: the first bucket of a version
opens one on every engine (/begin_weight_update), commit() closes it (/end_weight_update) before the
label. A session a failed push left open is closed and opened again by the next version.

Who waits on whom: connect() and send_bucket() block until every engine has replied; an engine
blocks in its receive until the broadcast arrives. If an engine refuses before joining the collective
(bad token, unsizeable metadata) the broadcast cannot complete: the error is raised at once and the
transport is marked out of step, so the next call says to reconnect instead of hanging.

The group runs on gloo or NCCL (sync.backend; broadcast_group.py chooses, builds the group on a
TCPStore this process hosts, never through init_process_group, and says why NCCL cannot run when it
cannot). On NCCL the trainer hands over tensors on its GPU (`takes_device_tensors`), the sender
flattens them into a buffer on that GPU and every engine receives into a buffer on its own: no host
round trip; verification then checksums on the GPUs (sum64), as for a CUDA IPC push. The engine's
end is BroadcastReceiver (broadcast_receiver.py).
An SGLang server with tensor parallelism joins with one rank per TP rank (its /get_server_info's
tp_size sets the rank offsets); the built-in engine with one.
Non-goals: CUDA IPC (colocated.py), multi-source fan-out (p2p.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.config.loader import ConfigError
from miles.devices import gpu_uuid
from miles.engine_api import routes
from miles.engine_api.extensions import common
from miles.net import LOOPBACK
from miles.sync import screen
from miles.sync.prepare import SyncConfig
from miles.sync.transports import broadcast_group
from miles.sync.transports import broadcast_wire as wire
from miles.sync.transports.base import TransportError, reconnect
from miles.sync.transports.broadcast_receiver import BroadcastReceiver
from miles.versions import to_wire

if TYPE_CHECKING:
    import torch

def _spawn(fn, *args) -> cf.Future:
    """Run fn on a daemon thread: a collective stuck on a dead peer must not block interpreter exit
    (a ThreadPoolExecutor's workers are joined at exit)."""
    fut: cf.Future = cf.Future()

    def run():
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
            fut.set_exception(exc)

    threading.Thread(target=run, name="miles-broadcast", daemon=True).start()
    return fut


# After an engine errors while our broadcast is still running, how long to let the broadcast finish
# before concluding the engine never joined it.
_GRACE_S = 2.0


@dataclass
class BroadcastConfig(SyncConfig):
    """The `sync` table when sync.transport = 'broadcast'."""

    transport: str = "broadcast"
    """How buckets reach the engines (see SyncConfig)."""
    backend: str = "auto"
    """The weight-update group's backend: auto (nccl when the trainer and every engine compute on GPUs
    of their own, else gloo), gloo (through host memory; any devices), or nccl (GPU to GPU)."""

    def validate(self) -> None:
        super().validate()
        if self.backend not in broadcast_group.BACKENDS:
            raise ConfigError(f"sync.backend = {self.backend!r}: choose auto (nccl when the trainer and every "
                              "engine compute on GPUs of their own, else gloo), gloo or nccl")


def _process_device() -> str:
    """Where this process sends from by default: its current GPU when torch sees one, else the host."""
    import torch

    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


class BroadcastTransport:
    """The sender: rank 0 of the group, the trainer's source of every bucket."""

    Config = BroadcastConfig
    supports_colocation = supports_lora = supports_pd_disaggregation = True

    def __init__(self, master_address: str = LOOPBACK, master_port: int = 0, backend: str = "gloo",
                 admin_token: str | None = None, timeout_s: float = 120.0,
                 group_name: str = "weight_update_group", load_format: str = "flattened_small",
                 keep_send_buffer: bool = True, device: str | None = None):
        """backend: auto, gloo or nccl (broadcast_group.choose decides at connect). device: where the
        trainer's tensors are (None: this process's GPU when it sees one, else cpu); on nccl buckets
        are sent from there, on gloo from host memory unless device names a GPU."""
        if backend not in broadcast_group.BACKENDS:
            raise ValueError(f"backend {backend!r}: use 'auto', 'gloo' or 'nccl'")
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend  # as asked; `group_backend` is what connect chose
        self.group_backend: str | None = None
        self.device_name = device
        self.device = None  # torch.device the sender's buffers live on, set by connect
        self.admin_token = admin_token
        self.timeout_s = timeout_s
        self.group_name = group_name
        if load_format not in ("flattened_small", "flattened_bucket"):
            raise ValueError(f"load_format {load_format!r}: use 'flattened_small' or 'flattened_bucket'")
        self.load_format = load_format
        self.wire_format = load_format  # what the engines get: load_format if they all offer it (connect)
        self.staged = True  # the engines stage buckets until commit (miles' `staged_commit` extension)
        self.engine_urls: list[str] = []
        self._store = None
        self._pg = None
        self._http = None
        self._broken: str | None = None
        self._fresh = True  # no bucket sent since the last commit: the next request resets engine staging
        self._version_failed = False  # a bucket of the pending version failed: commit must refuse
        self._flat = None  # (bytes,) uint8 the small tensors are flattened into, kept (and its pages with it)
        self._session = False  # plain engines: a weight-update session is open on every engine
        self.keep_send_buffer = keep_send_buffer  # false: a fresh one per bucket (many senders, e.g. p2p's)

    @classmethod
    def from_config(cls, cfg: SyncConfig, admin_token: str | None, base_path: str = "") -> BroadcastTransport:
        return cls(master_address=cfg.master_address or LOOPBACK, admin_token=admin_token, timeout_s=cfg.timeout_s,
                   backend=getattr(cfg, "backend", "auto"))  # a fallback from another transport's table: auto

    @property
    def takes_device_tensors(self) -> bool:
        """Whether the trainer should hand over tensors on its GPU (an NCCL group sends from there)."""
        return self.device is not None and self.device.type == "cuda"

    # ---- Transport ----------------------------------------------------------------------

    def connect(self, engine_urls: list[str]) -> None:
        import torch.distributed as dist

        self._http = reconnect(self, engine_urls, self.timeout_s + 30)
        infos = self._http.post_all(self.engine_urls, routes.GET_SERVER_INFO, None, method="GET")
        extensions = common(infos)
        self.staged = "staged_commit" in extensions  # else SGLang's apply-as-you-go form
        self.wire_format = self.load_format if self.load_format in extensions | {"flattened_bucket"} \
            else "flattened_bucket"
        self.group_backend, self.device = self._choose_backend(infos)
        offsets, world = broadcast_group.engine_ranks(infos)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # wait_for_workers=False: engines connect only after our POSTs reach them.
        self._store = dist.TCPStore(self.master_address, self.master_port, world, is_master=True,
                                    wait_for_workers=False, timeout=timeout)
        port = self._store.port
        replies = [_spawn(self._post, url, "/init_weights_update_group", {
            "master_address": self.master_address, "master_port": port, "rank_offset": rank,
            "world_size": world, "group_name": self.group_name, "backend": self.group_backend,
        }) for rank, url in zip(offsets, self.engine_urls)]

        def join():
            return broadcast_group.build(self._store, self.group_name, 0, world, self.group_backend, timeout)

        pg_future = _spawn(join)
        try:
            self._wait(pg_future, replies, "joining the weight-update group")
        except TransportError:
            self._broken = "connect failed"
            raise
        self._pg = pg_future.result()
        self._broken = None
        self._fresh, self._version_failed = True, False

    def _choose_backend(self, infos: list[dict]) -> tuple[str, "torch.device"]:
        """The group's backend (broadcast_group.choose, from where this process and every engine compute,
        as their server infos say) and the device the sender's buffers live on."""
        import torch

        device = torch.device(self.device_name or _process_device())
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        on_gpu = device.type == "cuda"
        source = broadcast_group.Member("the trainer", device.type, gpu_uuid(device) if on_gpu else None)
        engines = [broadcast_group.engine_member(u, i) for u, i in zip(self.engine_urls, infos)]
        chosen = broadcast_group.choose(self.backend, source, engines)
        # gloo sends from host memory unless told otherwise: a GPU tensor would cost gloo a copy per bucket.
        return chosen, device if chosen == "nccl" or self.device_name else torch.device("cpu")

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        import torch
        import torch.distributed as dist

        self._check_usable()
        if not bucket:
            return
        tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
        meta = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self.group_name,
            "load_format": self.wire_format,
        }
        if self.staged:
            meta.update(commit=False, reset_staging=self._fresh)
        else:  # applied at once; the cache is flushed once, when the version is complete
            meta.update(flush_cache=False)
            self._open_session()
        if self.wire_format == "flattened_small":
            meta.update(screened=True)  # the sender screens what it sends (screen.py); engines need not
        raw = [t.reshape(-1).view(torch.uint8) for t in tensors]
        total = sum(r.numel() for r in raw)
        replies = [_spawn(self._post, url, "/update_weights_from_distributed", meta)
                   for url in self.engine_urls]

        bad: list[str] = []  # tensors the sender found NaN/Inf in (flattened_small screens on the sender)

        def messages():
            if self.wire_format == "flattened_bucket":
                yield torch.cat(raw)  # (total_bytes,) uint8, each tensor's bytes in bucket order
                return
            sizes = [r.numel() for r in raw]
            plan, offsets, flat_bytes = wire.message_plan(sizes)
            flat = self._send_buffer(flat_bytes)
            for message in plan:
                items = [(meta["names"][i], tensors[i]) for i in message]
                if offsets[message[0]] < 0:
                    yield raw[message[0]]
                    bad.extend(screen.nonfinite(items))  # while gloo sends it
                    continue
                bad.extend(screen.copy_screened([flat], items, [offsets[i] for i in message]))
                lo, hi = wire.span(message, offsets, sizes)
                yield flat[lo:hi]

        def broadcast():
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            opts.timeout = datetime.timedelta(seconds=self.timeout_s)
            with broadcast_group.current(self.device), broadcast_group.explained(self.group_backend):
                # Each message is queued as soon as it is flattened: the group sends it while the next one
                # is copied, and runs them in order, so none waits for the one before it to be acknowledged.
                works = [self._pg.broadcast([m], opts) for m in messages() if m.numel()]
                for w in works:
                    w.wait()
                broadcast_group.finish(self.device)  # the send buffer is free for the next bucket

        self._fresh = False
        what = f"sending a bucket of {len(bucket)} tensors ({total} bytes, first {bucket[0][0]!r})"
        try:
            self._wait(_spawn(broadcast), replies, what)
        except TransportError:
            self._version_failed = True
            raise
        if bad:  # the engines staged it unread, trusting the screen: the version must not commit
            self._version_failed = True
            raise TransportError(f"weight sync failed while {what}: tensor {bad[0]!r} contains NaN or Inf; "
                                 "nothing of this version is applied")

    def _send_buffer(self, nbytes: int) -> "torch.Tensor":
        """The flat send buffer, grown to `nbytes`: kept across buckets and versions, so flattening
        writes into pages already mapped (a fresh buffer's first touch costs about a copy's time).
        Unless keep_send_buffer is off: one sender per engine (p2p across hosts) would keep one each."""
        import torch

        if not self.keep_send_buffer:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self._flat is None or self._flat.numel() < nbytes:
            self._flat = None  # the smaller one is freed before the larger is taken (GPU memory)
            self._flat = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        return self._flat

    def commit(self, weight_version: int) -> None:
        self._check_usable()
        if not self.staged:
            self._commit_plain(weight_version)
            return
        if self._version_failed:
            # Committing the buckets that did arrive would publish a version that never existed.
            self._version_failed, self._fresh = False, True
            reset = {"names": [], "group_name": self.group_name, "commit": False, "reset_staging": True}
            for f in [_spawn(self._post, url, "/update_weights_from_distributed", reset)
                      for url in self.engine_urls]:
                f.exception()
            raise TransportError(f"not committing weight version {weight_version}: a bucket of it failed "
                                 "to reach every engine; engines keep their previous weights")
        body = {"names": [], "dtypes": [], "shapes": [], "group_name": self.group_name,
                "load_format": "flattened_bucket", "commit": True, "weight_version": to_wire(weight_version),
                "reset_staging": self._fresh}
        replies = [_spawn(self._post, url, "/update_weights_from_distributed", body)
                   for url in self.engine_urls]
        self._fresh = True
        self._wait(None, replies, f"committing weight version {weight_version}")

    def _open_session(self) -> None:
        """SGLang's weight-update session on every engine, once per version (see the module docstring)."""
        if self._session:
            return
        replies = [_spawn(self._post, url, "/begin_weight_update", {}) for url in self.engine_urls]
        try:
            self._wait(None, replies, "opening a weight-update session (/begin_weight_update)")
        except TransportError as exc:
            if "already open" not in str(exc):
                raise
            # Left open by a push that failed midway: close it (its weights are replaced now) and reopen.
            self._close_session(quiet=True)
            replies = [_spawn(self._post, url, "/begin_weight_update", {}) for url in self.engine_urls]
            self._wait(None, replies, "opening a weight-update session (/begin_weight_update)")
        self._session = True

    def _close_session(self, quiet: bool = False) -> None:
        replies = [_spawn(self._post, url, "/end_weight_update", {}) for url in self.engine_urls]
        self._session = False
        if quiet:
            cf.wait(replies, timeout=self.timeout_s)
            return
        self._wait(None, replies, "closing the weight-update session (/end_weight_update)")

    def _commit_plain(self, weight_version: int) -> None:
        """SGLang has applied every bucket already: close the session, label the version and drop KV
        of the old one."""
        if self._version_failed:
            self._version_failed = False
            raise TransportError(f"weight version {weight_version} failed to reach every engine; SGLang applies "
                                 "buckets as they arrive, so engines hold part of it until the next push")
        if self._session:
            self._close_session()
        label = {"new_version": to_wire(weight_version), "abort_all_requests": False}
        # /flush_cache takes no body in SGLang; it succeeds while paused (the queue is ignored then).
        for path, body in (("/update_weight_version", label), ("/flush_cache", None)):
            replies = [_spawn(self._post, url, path, body) for url in self.engine_urls]
            self._wait(None, replies, f"committing weight version {weight_version} ({path})")

    def channels(self) -> dict[str, str]:
        """How each engine is reached: the group's master, where its members join."""
        return {url: f"broadcast via {self.master_address}" for url in self.engine_urls}

    def close(self) -> None:
        if self._http is not None and self._pg is not None and self._broken is None:
            for url in self.engine_urls:  # best effort: the engines drop their end of the group
                try:
                    self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name})
                except TransportError:
                    pass
        if self._http is not None:
            self._http.close()
        self._pg = self._store = self._http = self._flat = None

    # ---- internals ----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._pg is None:
            raise TransportError("broadcast transport is not connected: call connect(engine_urls) first")
        if self._broken is not None:
            raise TransportError(f"broadcast transport is out of step with the engines ({self._broken}): "
                                 "call close() and connect(engine_urls) again")

    def _post(self, url: str, path: str, body: dict) -> dict:
        return self._http.post(url, path, body)

    def _wait(self, collective: cf.Future | None, replies: list[cf.Future], what: str) -> None:
        """Wait for the collective and every engine's reply; raise one error naming every failed engine."""
        pending = set(replies) | ({collective} if collective is not None else set())
        deadline = time.monotonic() + self.timeout_s + 60
        while pending:
            done, pending = cf.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                    return_when=cf.FIRST_EXCEPTION)
            if not done:
                self._broken = f"timed out {what}"
                raise TransportError(f"timed out after {self.timeout_s}s {what}")
            if any(f.exception() is not None for f in done):
                break
        if collective is not None and not collective.done():
            # An engine failed before the collective finished: it may have errored after its receive
            # (still in step) or without ever joining (out of step). Give the collective a moment.
            cf.wait([collective], timeout=_GRACE_S)
            if not collective.done():
                self._broken = f"an engine failed while {what}"
        cf.wait(replies, timeout=_GRACE_S)
        errors = [str(f.exception()) for f in replies if f.done() and f.exception() is not None]
        if collective is not None and collective.done() and collective.exception() is not None:
            self._broken = f"the collective failed while {what}"
            errors.append(f"collective failed: {collective.exception()}")
        if errors:
            raise TransportError(f"weight sync failed while {what}: " + "; ".join(errors))


BroadcastTransport.Receiver = BroadcastReceiver  # the engine's end (broadcast_receiver.py)
