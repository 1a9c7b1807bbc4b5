"""Point-to-point transport: the trainer's source writes each bucket into each engine's own memory.

Broadcast fans every bucket out through one collective; p2p instead gives every engine its own
channel, so one engine's transfer never waits on another's and nothing is relayed:
  * an engine on the sender's node (the address of its Ray node, or this machine's name) lends a receive buffer in shared memory
    (`/p2p_open_buffer`) big enough for a whole version; the trainer copies each tensor's bytes
    straight into it, bucket after bucket at increasing offsets; the bytes are in the engine's memory
    when send_bucket returns. The layout of the whole version travels once, with the commit, so a
    version costs one HTTP call per engine. The buffer is the engine's staging, and a whole version
    in it becomes the engine's parameters at commit (`swap_buffers`): the engine then lends the
    buffer its parameters left for the next version, so each byte is copied exactly once, by the
    trainer. Engines are written concurrently. When a version outgrows the buffer, what was written
    is staged from it and the engine lends a bigger one.
  * an engine on another node gets a private two-rank gloo group and point-to-point sends over it
    (one BroadcastTransport of world size 2 per engine, all running at once).
Engines apply the version at commit, all of it at once, as with every transport (base.py).
The engine's end (Receiver) lends the buffers (/p2p_open_buffer, /p2p_close_buffer) and, at a
swapping commit, moves the parameters into the buffer the version arrived in; the buckets themselves
are staged through the colocated transport's /update_weights_from_tensor (the same shared-memory
route), and tcp engines through the broadcast transport's routes.
Non-goals: RDMA (a GPU build would register the receive buffers with the NIC instead).
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from miles.config.loader import ConfigError
from miles.engine_api.client import EngineClient
from miles.net import LOOPBACK, resolve
from miles.sync import screen, shm
from miles.sync.prepare import SyncConfig
from miles.sync.transports.base import TransportError, TransportReceiver, WeightUpdateError, reconnect
from miles.sync.transports.broadcast import BroadcastTransport
from miles.versions import to_wire

if TYPE_CHECKING:
    import torch

# The most shared-memory buffers one engine lends at once (a version's, the one it serves from, the
# next one, and room for a sender that reconnects).
MAX_BUFFERS = 8


def is_local(url: str, node_address: str = LOOPBACK) -> bool:
    """Whether an engine URL points at the sender's node (so shared memory reaches it).

    The sender's node is `node_address` (its Ray node) and this machine itself: its names and network
    addresses, and its own loopback (LOOPBACK, IPv6's, and names that resolve to nothing else).
    Any other loopback address counts as another node: Ray nodes on one machine are told apart by such
    addresses, and Ray never gives a node LOOPBACK itself (it swaps that for the network address).
    """
    host = (urlparse(url).hostname or "").lower()
    if host == node_address.lower():
        return True
    try:
        return _machine_loopback_or_address(ipaddress.ip_address(host))
    except ValueError:
        pass  # a name
    try:
        if host in {socket.gethostname().lower(), socket.getfqdn().lower()}:
            return True
    except OSError:
        return False
    addresses = resolve(host)
    return bool(addresses) and all(_machine_loopback_or_address(a) for a in addresses)


def _machine_loopback_or_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if ip.is_loopback:
        return ip.version == 6 or str(ip) == LOOPBACK
    try:
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return str(ip) in mine


@dataclass
class P2PConfig(SyncConfig):
    """The `sync` table when sync.transport = 'p2p' (receive buffers start at sync.bucket_size_mb)."""

    transport: str = "p2p"
    """How buckets reach the engines (see SyncConfig)."""
    p2p_mode: str = "auto"
    """p2p channel: auto (shared memory on this host, point-to-point sends across hosts), shm or tcp."""

    def validate(self) -> None:
        super().validate()
        if self.p2p_mode not in ("auto", "shm", "tcp"):
            raise ConfigError(f"sync.p2p_mode {self.p2p_mode!r}: choose auto, shm or tcp")


class P2PTransport:
    """The sender: writes into every engine's lent buffer, or sends over a private group per engine."""

    Config = P2PConfig
    supports_colocation = supports_lora = supports_pd_disaggregation = True

    def __init__(self, mode: str = "auto", admin_token: str | None = None, timeout_s: float = 120.0,
                 buffer_bytes: int = 64 << 20, master_address: str = LOOPBACK):
        if mode not in ("auto", "shm", "tcp"):
            raise ValueError(f"p2p mode {mode!r}: use 'auto' (shared memory on this host, sends across hosts), "
                             "'shm' or 'tcp'")
        self.mode, self.admin_token, self.timeout_s = mode, admin_token, timeout_s
        self.buffer_bytes, self.master_address = buffer_bytes, master_address
        self.engine_urls: list[str] = []
        self._client: EngineClient | None = None
        self._shm: dict[str, tuple[str, "torch.Tensor"]] = {}  # url -> (path, mapping) of the engine's buffer
        self._mapped: dict[str, "torch.Tensor"] = {}  # path -> mapping, for the buffers engines alternate between
        self._tcp: dict[str, object] = {}  # url -> BroadcastTransport over a 2-rank group
        self._fresh = True
        self._failed: str | None = None
        self._cursor = 0  # where the next bucket of this version starts in every engine's buffer
        self._layout = _empty_layout()  # tensors written into the current buffers, not yet announced

    @classmethod
    def from_config(cls, cfg: P2PConfig, admin_token: str | None, base_path: str = "") -> P2PTransport:
        return cls(mode=cfg.p2p_mode, admin_token=admin_token, timeout_s=cfg.timeout_s, buffer_bytes=cfg.buffer_bytes,
                   master_address=cfg.master_address or LOOPBACK)

    def connect(self, engine_urls: list[str]) -> None:
        self._client = reconnect(self, engine_urls, self.timeout_s)
        local = [u for u in self.engine_urls
                 if self.mode == "shm" or (self.mode == "auto" and is_local(u, self.master_address))]
        remote = [u for u in self.engine_urls if u not in local]
        for url, r in zip(local, self._client.post_all(local, "/p2p_open_buffer", {"nbytes": self.buffer_bytes})):
            size = r.get("nbytes", self.buffer_bytes)  # an engine lends at most its model's size
            self._shm[url] = (r["shm_path"], shm.attach(r["shm_path"], size)[:size])
        for i, url in enumerate(remote):
            self._tcp[url] = BroadcastTransport(master_address=self.master_address, admin_token=self.admin_token,
                                                timeout_s=self.timeout_s, group_name=f"miles_p2p_{i}",
                                                keep_send_buffer=False)
        self._client.run_all([lambda t=t, u=u: t.connect([u]) for u, t in self._tcp.items()])
        self._fresh, self._failed, self._cursor = True, None, 0

    def send_bucket(self, bucket: list[tuple[str, "torch.Tensor"]]) -> None:
        self._check()
        if not bucket:
            return
        bucket = [(n, t.detach().to("cpu").contiguous()) for n, t in bucket]
        rel, nbytes = shm.layout(bucket)
        start = (self._cursor + 63) // 64 * 64
        offsets = [start + o for o in rel]
        meta = shm.bucket_meta(bucket, offsets)
        grow = any(buf.numel() < start + nbytes for _, buf in self._shm.values())
        announced, reset = self._layout, self._fresh  # reset: drop what an abandoned version left staged
        if grow:
            self._layout, self._fresh = _empty_layout(), False
        for k in self._layout:
            self._layout[k] += meta[k]
        self._cursor = start + nbytes

        def grow(url: str) -> None:
            # Stage what the old buffer holds (it stays mapped on the engine until commit), then take a
            # bigger one, with headroom so that this happens about once per run.
            path, _ = self._shm[url]
            self._client.post(url, "/update_weights_from_tensor", {
                **announced, "shm_path": path, "load_format": "shm", "commit": False, "reset_staging": reset,
                "screened": True})
            self._client.post(url, "/p2p_close_buffer", {"shm_path": path})
            r = self._client.post(url, "/p2p_open_buffer", {"nbytes": (start + nbytes) * 5 // 4})
            path, size = r["shm_path"], r.get("nbytes", (start + nbytes) * 5 // 4)
            if size < start + nbytes:
                raise TransportError(f"engine {url}: lent a buffer of {size} bytes, smaller than this version "
                                     f"needs ({start + nbytes} bytes): is the sender's model the engine's?")
            self._shm[url] = (path, shm.attach(path, size)[:size])

        def to_shm() -> None:
            for url in [u for u, (_, buf) in self._shm.items() if buf.numel() < start + nbytes]:
                grow(url)
            # One pass writes every engine's copy and screens the bytes for NaN/Inf: engines adopt a
            # lent buffer without reading it again (the commit says `screened`).
            bufs = [buf for _, buf in self._shm.values()]
            bad = screen.copy_screened(bufs, bucket, offsets, threads=min(len(bufs), os.cpu_count() or 1))
            if bad:
                raise TransportError(f"tensor {bad[0]!r} contains NaN or Inf; nothing of this version is applied")

        jobs = ([to_shm] if self._shm else []) + [lambda t=t: t.send_bucket(bucket) for t in self._tcp.values()]
        try:
            self._client.run_all(jobs)
        except TransportError as exc:
            self._failed = str(exc)
            raise TransportError(f"p2p: sending a bucket of {len(bucket)} tensors (first {bucket[0][0]!r}) "
                                 f"failed: {exc}") from None

    def channels(self) -> dict[str, str]:
        """How each engine is reached: shared memory on the sender's node, sends over the network else."""
        return {url: "p2p shm" if url in self._shm else f"p2p tcp via {self.master_address}" for url in self.engine_urls}

    def commit(self, weight_version: int) -> None:
        self._check()
        shm_urls = list(self._shm)
        layout, fresh = self._layout, self._fresh
        self._fresh, self._cursor, self._layout = True, 0, _empty_layout()
        if self._failed is not None:
            why, self._failed = self._failed, None
            reset = {"names": [], "reset_staging": True, "commit": False, "load_format": "shm"}
            for fn in [lambda: self._client.post_all(shm_urls, "/update_weights_from_tensor", reset)] + [
                    lambda t=t: t.commit(weight_version) for t in self._tcp.values()]:
                try:
                    fn()
                except TransportError:
                    pass  # tcp engines refuse their own commit: that is the point
            raise TransportError(f"not committing weight version {weight_version}: a bucket of it failed ({why}); "
                                 "engines keep their previous weights")
        body = {**layout, "load_format": "shm", "commit": True, "weight_version": to_wire(weight_version),
                "reset_staging": fresh, "swap_buffers": True, "screened": True}
        replies, *_ = self._client.run_all(
            [lambda: self._client.post_all(shm_urls, "/update_weights_from_tensor",
                                           lambda _i, url: {**body, "shm_path": self._shm[url][0]})]
            + [lambda t=t: t.commit(weight_version) for t in self._tcp.values()])
        for url, reply in zip(shm_urls, replies):
            self._switch(url, reply.get("shm_path", self._shm[url][0]))

    def _switch(self, url: str, path: str) -> None:
        """Write the engine's next version into `path` (its parameters now live in the old one)."""
        old_path, old_buf = self._shm[url]
        if path == old_path:
            return
        self._mapped[old_path] = old_buf
        buf = self._mapped.pop(path, None)
        if buf is None:
            buf = shm.attach(path, old_buf.numel())
        self._shm[url] = (path, buf)
        while len(self._mapped) > len(self._shm):  # one spare mapping per engine: the buffer it alternates with
            self._mapped.pop(next(iter(self._mapped)))

    def close(self) -> None:
        for url, (path, _) in list(self._shm.items()):
            try:
                self._client.post(url, "/p2p_close_buffer", {"shm_path": path})
            except TransportError:
                pass  # the engine is gone; its buffer went with it or is reclaimed at its exit
        self._shm.clear()
        self._mapped.clear()
        for t in self._tcp.values():
            t.close()
        self._tcp.clear()
        if self._client is not None:
            self._client.close()
        self._client = None

    def _check(self) -> None:
        if self._client is None:
            raise TransportError("p2p transport is not connected: call connect(engine_urls) first")


def _empty_layout() -> dict[str, list]:
    return {"names": [], "dtypes": [], "shapes": [], "offsets": []}


# ---- engine side ----------------------------------------------------------------------------------


class P2PReceiver(TransportReceiver):
    """The engine's end: shared-memory buffers this engine owns and lends a p2p sender."""

    extension = "p2p"

    def __init__(self, weights):
        super().__init__(weights)
        self._buffers: dict[str, "torch.Tensor"] = {}  # path -> mapping of buffers this engine owns
        self._serving: str | None = None  # the lent buffer the parameters live in, if any
        self._write_next: dict[str, str] = {}  # buffer committed from -> buffer to write the next version to

    def mount(self, api) -> None:
        api.post("/p2p_open_buffer", self._open_route, fields={"nbytes"})
        api.post("/p2p_close_buffer", self._close_route, fields={"shm_path"})

    def _open_route(self, body: dict) -> dict:
        nbytes = body.get("nbytes")
        if type(nbytes) is not int or nbytes <= 0:
            raise WeightUpdateError("nbytes: expected a positive integer (the largest bucket in bytes)")
        # A whole version never needs more than the model's size (with alignment and headroom): a larger
        # ask is lent that much, and the reply says how much it got.
        nbytes = min(nbytes, self.max_buffer_bytes())
        with self.weights.lock:
            if len(self._buffers) >= MAX_BUFFERS:
                raise WeightUpdateError(f"nbytes: this engine already lends {len(self._buffers)} buffers, the "
                                        f"most it holds; close one (/p2p_close_buffer) before opening another")
        free = shm.free_bytes()
        if nbytes > free:
            # Pages of a full tmpfs fail on first touch (SIGBUS kills the engine): refuse instead.
            raise WeightUpdateError(f"nbytes: {nbytes} bytes do not fit in the {free} bytes free in {shm.SHM_DIR}; "
                                    "free shared memory or use sync.transport = 'broadcast'")
        return {"success": True, "shm_path": self.open_buffer(nbytes), "nbytes": nbytes}

    def max_buffer_bytes(self) -> int:
        """The largest buffer a sender needs: the whole model at 4 bytes (or its own dtype's, if wider)
        per element, each tensor 64-byte aligned, with the sender's 5/4 growth headroom and 1 MiB more."""
        meta = self.weights.engine.param_meta
        payload = sum(math.prod(shape) * max(4, dtype.itemsize) + 64
                      for shape, dtype in meta.values())
        return payload * 5 // 4 + (1 << 20)

    def _close_route(self, body: dict) -> dict:
        self.close_buffer(str(body.get("shm_path")))
        return {"success": True}

    def open_buffer(self, nbytes: int) -> str:
        """Create a receive buffer this engine owns; a p2p sender writes a whole version straight into it."""
        path, buf = shm.create(nbytes, tag="p2p", touch=True)
        with self.weights.lock:
            self._buffers[path] = buf
        return path

    def close_buffer(self, path: str) -> None:
        with self.weights.lock:
            # The buffer the parameters live in outlives its sender: only the engine's exit frees it.
            if path != self._serving and self._buffers.pop(path, None) is not None:
                shm.unlink(path)
            nxt = self._write_next.pop(path, None)
            if nxt is not None and nxt != self._serving and self._buffers.pop(nxt, None) is not None:
                shm.unlink(nxt)

    def lent(self, path: str):
        return self._buffers.get(path)

    def write_next(self, path: str) -> str | None:
        return self._write_next.get(path)

    def committed(self, adopted: str | None) -> None:
        if adopted is not None and adopted in self._buffers:
            self._write_next[adopted] = self._swap_serving(adopted)

    def _swap_serving(self, source: str) -> str:
        """The parameters now live in `source`; return the buffer the next version goes to: the one
        they left if nothing points into it any more, else a fresh one of the same size."""
        old, self._serving = self._serving, source
        size = self._buffers[source].numel()
        if old is not None and old != source and old in self._buffers:
            buf = self._buffers[old]
            if buf.numel() >= size and not self.weights.engine.points_into(buf):
                return old
        path, buf = shm.create(size, tag="p2p", touch=True)
        self._buffers[path] = buf
        return path

    def close(self) -> None:
        for path in self._buffers:
            shm.unlink(path)  # mappings the parameters still use stay valid until they are freed
        self._buffers.clear()


P2PTransport.Receiver = P2PReceiver  # the engine's end, defined after the sender it answers
