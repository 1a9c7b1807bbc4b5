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
updater pauses the engines around the whole push, since SGLang has no staging.

Who waits on whom: connect() and send_bucket() block until every engine has replied; an engine
blocks in its receive until the broadcast arrives. If an engine refuses before joining the collective
(bad token, unsizeable metadata) the broadcast cannot complete: the error is raised at once and the
transport is marked out of step, so the next call says to reconnect instead of hanging.

The group is built directly on a TCPStore this process hosts (ProcessGroupGloo over a PrefixStore),
never through init_process_group, so a trainer's default (FSDP) group is neither used nor disturbed.
The engine's end (Receiver, SGLang's `update_weights_from_distributed` plus miles' staging):
  * /init_weights_update_group joins a stand-alone gloo group whose rank 0 (the trainer's source)
    hosts the TCPStore. The default process group is never created or touched, so an engine can share
    a process with other torch.distributed users.
  * /update_weights_from_distributed first completes the broadcast(s) - always, even when the
    metadata is wrong, so every member of the collective stays in step - then validates names/shapes
    against the model and stages the tensors (commit=true then applies the version).
Non-goals: NCCL/CUDA IPC (a GPU variant would swap the backend), multi-source fan-out (p2p.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.engine_api import bodies
from miles.net import LOOPBACK
from miles.sync import screen
from miles.sync.transports import broadcast_wire as wire
from miles.sync.prepare import SyncConfig
from miles.sync.transports.base import TransportError, TransportReceiver, WeightUpdateError, reconnect
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


class BroadcastTransport:
    """The sender: rank 0 of the group, the trainer's source of every bucket."""

    Config = SyncConfig  # no settings of its own
    supports_colocation = supports_lora = supports_pd_disaggregation = True

    def __init__(self, master_address: str = LOOPBACK, master_port: int = 0, backend: str = "gloo",
                 admin_token: str | None = None, timeout_s: float = 120.0,
                 group_name: str = "weight_update_group", load_format: str = "flattened_small",
                 keep_send_buffer: bool = True):
        if backend != "gloo":
            raise ValueError(f"backend {backend!r}: the broadcast transport runs on CPU tensors; use 'gloo'")
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
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
        self.keep_send_buffer = keep_send_buffer  # false: a fresh one per bucket (many senders, e.g. p2p's)

    @classmethod
    def from_config(cls, cfg: SyncConfig, admin_token: str | None, base_path: str = "") -> BroadcastTransport:
        return cls(master_address=cfg.master_address or LOOPBACK, admin_token=admin_token, timeout_s=cfg.timeout_s)

    # ---- Transport ----------------------------------------------------------------------

    def connect(self, engine_urls: list[str]) -> None:
        import torch.distributed as dist

        self._http = reconnect(self, engine_urls, self.timeout_s + 30)
        extensions = self._http.extensions(self.engine_urls)
        self.staged = "staged_commit" in extensions  # else SGLang's apply-as-you-go form
        self.wire_format = self.load_format if self.load_format in extensions | {"flattened_bucket"} \
            else "flattened_bucket"
        world = 1 + len(self.engine_urls)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # wait_for_workers=False: engines connect only after our POSTs reach them.
        self._store = dist.TCPStore(self.master_address, self.master_port, world, is_master=True,
                                    wait_for_workers=False, timeout=timeout)
        port = self._store.port
        replies = [_spawn(self._post, url, "/init_weights_update_group", {
            "master_address": self.master_address, "master_port": port, "rank_offset": rank,
            "world_size": world, "group_name": self.group_name, "backend": self.backend,
        }) for rank, url in enumerate(self.engine_urls, start=1)]

        def join():
            return dist.ProcessGroupGloo(dist.PrefixStore(self.group_name, self._store), 0, world, timeout)

        pg_future = _spawn(join)
        try:
            self._wait(pg_future, replies, "joining the weight-update group")
        except TransportError:
            self._broken = "connect failed"
            raise
        self._pg = pg_future.result()
        self._broken = None
        self._fresh, self._version_failed = True, False

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        import torch
        import torch.distributed as dist

        self._check_usable()
        if not bucket:
            return
        tensors = [t.detach().to("cpu").contiguous() for _, t in bucket]
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
            # Each message is queued as soon as it is flattened: gloo sends it while the next one is
            # copied, and runs them in order, so none waits for the one before it to be acknowledged.
            works = [self._pg.broadcast([m], opts) for m in messages() if m.numel()]
            for w in works:
                w.wait()

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
            return torch.empty(nbytes, dtype=torch.uint8)
        if self._flat is None or self._flat.numel() < nbytes:
            self._flat = torch.zeros(nbytes, dtype=torch.uint8)
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

    def _commit_plain(self, weight_version: int) -> None:
        """SGLang has applied every bucket already: label the version and drop KV of the old one."""
        if self._version_failed:
            self._version_failed = False
            raise TransportError(f"weight version {weight_version} failed to reach every engine; SGLang applies "
                                 "buckets as they arrive, so engines hold part of it until the next push")
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


# ---- engine side ----------------------------------------------------------------------------------


@dataclass
class _Group:
    pg: object  # torch.distributed.ProcessGroupGloo
    store: object  # keeps the TCPStore client alive as long as the group
    rank: int
    world_size: int


class BroadcastReceiver(TransportReceiver):
    """The engine's end: join the trainer's group, receive each bucket's broadcast into staging."""

    def __init__(self, weights):
        super().__init__(weights)
        self._groups: dict[str, _Group] = {}
        self._groups_lock = threading.Lock()  # guards _groups only; never held across a network wait
        self._api = None  # the engine's weight routes, set by mount

    def mount(self, api) -> None:
        # SGLang's routes: their bodies are checked by bodies.parse_*, unauthorized as the server's.
        self._api = api
        api.post("/init_weights_update_group", self._init_route, sglang=True)
        api.post("/destroy_weights_update_group", self._destroy_route, sglang=True)
        api.post("/update_weights_from_distributed", self._update_route, sglang=True, stages=True)

    def _init_route(self, body: dict) -> dict:
        # Joining blocks until every member arrives (the caller runs this off the event loop).
        req = bodies.parse_body(bodies.InitWeightsUpdateGroup, body)
        message = self.init_group(req.master_address, req.master_port, req.rank_offset, req.world_size,
                                  req.group_name, req.backend)
        return {"success": True, "message": message}

    def _destroy_route(self, body: dict) -> dict:
        self.destroy_group(bodies.parse_body(bodies.DestroyWeightsUpdateGroup, body).group_name)
        return {"success": True, "message": "group destroyed"}

    def _update_route(self, body: dict) -> dict:
        req = self._api.parse(bodies.UpdateWeightsFromDistributed, bodies.MilesUpdateWeightsFromDistributed,
                              body)
        commit = getattr(req, "commit", True)  # SGLang's form: every request applies what it carries
        if getattr(req, "reset_staging", False):
            self.weights.reset_staging()
        if req.load_format == "flattened_small" and self._api.sglang_only:
            raise WeightUpdateError("load_format: 'flattened_small' is a miles extension, not served in SGLang-only "
                                    "mode; use 'flattened_bucket' or null")
        try:
            self.receive(req.names, req.dtypes, req.shapes, req.group_name, req.load_format,
                         screened=getattr(req, "screened", False))
        except WeightUpdateError:
            if commit:  # this request closed its version (SGLang single-shot); it failed as a whole
                self.weights.reset_staging()
            raise
        if not commit:
            return {"success": True, "message": f"staged {len(req.names)} tensors"}
        if req.abort_all_requests:
            self.weights.engine.abort()
        version = self.weights.commit(req.weight_version, flush_cache=req.flush_cache)
        reply = {"success": True, "message": f"Succeeded to update parameter online (version {version})."}
        return reply if self._api.sglang_only else {**reply, "weight_version": version}

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str = "weight_update_group", backend: str = "gloo") -> str:
        import torch.distributed as dist

        if backend != "gloo":
            raise WeightUpdateError(f"backend: the built-in engine runs on CPU and only supports 'gloo', "
                                    f"got {backend!r}")
        if not 1 <= rank_offset < world_size:
            raise WeightUpdateError(f"rank_offset: {rank_offset} must be in [1, world_size={world_size}); "
                                    "rank 0 is the trainer's source")
        w = self.weights
        # The rendezvous runs under no lock: a trainer that never shows up (a closed port, a dead peer)
        # costs this request its deadline and nothing else; /destroy_weights_update_group, /health and
        # the other weight routes answer meanwhile. One deadline covers the store and the group.
        limit = w.timeout.total_seconds()
        deadline = time.monotonic() + limit
        try:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=w.timeout)
            left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
            # The prefix keeps several groups (or a re-initialised one) from colliding in one store.
            pg = dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank_offset, world_size, left)
        except Exception as exc:  # noqa: BLE001 - torch's store and gloo errors: the rendezvous failed
            raise WeightUpdateError(f"master_address/master_port: joining weight-update group {group_name!r} at "
                                    f"{master_address}:{master_port} failed within the {limit:g}s deadline "
                                    f"(engine weight_update_timeout_s): {type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        with w.lock:
            with self._groups_lock:
                self._groups[group_name] = _Group(pg, store, rank_offset, world_size)
            w.clear()
        return f"joined {group_name!r} as rank {rank_offset} of {world_size}"

    def destroy_group(self, group_name: str) -> None:
        # Not the weight lock: a receive in progress keeps its own reference to the group and ends
        # at its deadline, while this answers at once.
        with self._groups_lock:
            self._groups.pop(group_name, None)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                group_name: str = "weight_update_group", load_format: str | None = None,
                screened: bool = False) -> None:
        """Receive one bucket into staging; raises WeightUpdateError (staging discarded) on bad data.
        screened: the sender screened a flattened_small bucket for NaN/Inf, so it is staged unread."""
        if not names:
            return
        w = self.weights
        with w.lock:
            with self._groups_lock:
                group = self._groups.get(group_name)
            if group is None:
                raise WeightUpdateError(f"group_name: no weight-update group {group_name!r}; call "
                                        "/init_weights_update_group first")
            # Without dtypes and shapes the receive cannot be sized, so the sender's broadcast will
            # time out: nothing better can be done than refusing at once.
            if not len(names) == len(dtypes) == len(shapes):
                raise w.fail(f"names, dtypes and shapes must have equal lengths, got "
                             f"{len(names)}, {len(dtypes)}, {len(shapes)}")
            specs = w.specs(names, dtypes, shapes)
            try:
                received, nonfinite = self._broadcast(group, specs, load_format, screened)
            except WeightUpdateError:
                raise
            except Exception as exc:  # noqa: BLE001 - a dead or late peer; the group is unusable now
                with self._groups_lock:
                    if self._groups.get(group_name) is group:
                        self._groups.pop(group_name)
                raise w.fail(f"receiving from group {group_name!r} failed ({exc}); re-initialise the "
                             "group with /init_weights_update_group") from None
            err = w.validate(received, nonfinite)
            if err is not None:
                raise w.fail(err)
            w.stage(received, owned=True)

    def _broadcast(self, group: _Group, specs, load_format: str | None, screened: bool = False
                   ) -> tuple[dict[str, "torch.Tensor"], set[str] | None]:
        """The received tensors, and the names among them holding NaN/Inf when the format screens
        them on arrival or the sender did (flattened_small; None otherwise)."""
        import torch.distributed as dist

        w = self.weights
        if load_format not in wire.FORMATS:
            raise w.fail(f"load_format: {load_format!r} is not supported; use 'flattened_bucket', "
                         "'flattened_small' or null")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = w.timeout
        return wire.receive(group.pg, opts, specs, load_format, screened, w.buffer)


BroadcastTransport.Receiver = BroadcastReceiver  # the engine's end, defined after the sender it answers
