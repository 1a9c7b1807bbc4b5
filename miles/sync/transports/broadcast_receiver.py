"""The broadcast transport's engine end (BroadcastReceiver): SGLang's weight-update group routes
with miles' staging. The sender is BroadcastTransport (broadcast.py).

  * /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
    backend} joins a stand-alone group (gloo or nccl, broadcast_group.py) whose rank 0 (the trainer's
    source) hosts the TCPStore. The default process group is never created or touched, so an engine
    can share a process with other torch.distributed users. nccl is refused on an engine on the cpu.
  * /update_weights_from_distributed first completes the broadcast(s) - always, even when the
    metadata is wrong, so every member of the collective stays in step - then validates names/shapes
    against the model and stages the tensors (commit=true then applies the version). Buckets are
    received into buffers on the engine's device: on NCCL straight from the trainer's GPU; gloo
    copies through the host itself.
  * /destroy_weights_update_group drops the engine's end of a group.
Non-goals: the sender, the message formats (broadcast_wire.py), SGLang's tensor-parallel ranks.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.engine_api import bodies
from miles.sync.transports import broadcast_group
from miles.sync.transports import broadcast_wire as wire
from miles.sync.transports.base import TransportReceiver, WeightUpdateError

if TYPE_CHECKING:
    import torch


@dataclass
class _Group:
    pg: object  # a torch.distributed ProcessGroupGloo or ProcessGroupNCCL
    store: object  # keeps the TCPStore client alive as long as the group
    rank: int
    world_size: int
    device: object = None  # torch.device buckets are received into: the engine's


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
        import torch
        import torch.distributed as dist

        runner = getattr(self.weights.engine, "runner", None)
        device = getattr(runner, "device", None) or torch.device("cpu")
        if backend not in ("gloo", "nccl"):
            raise WeightUpdateError(f"backend: {backend!r} is not served; use 'gloo' (any device) or 'nccl' (GPUs)")
        if backend == "nccl" and device.type != "cuda":
            raise WeightUpdateError(f"backend: 'nccl' moves GPU memory only, and this engine computes on {device}; "
                                    "send backend 'gloo' (sync.backend = 'gloo' or 'auto'), or run the engine on "
                                    "a GPU (rollout.engine.device = 'cuda')")
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
            pg = broadcast_group.build(store, group_name, rank_offset, world_size, backend, left)
        except Exception as exc:  # noqa: BLE001 - torch's store and gloo errors: the rendezvous failed
            raise WeightUpdateError(f"master_address/master_port: joining weight-update group {group_name!r} at "
                                    f"{master_address}:{master_port} failed within the {limit:g}s deadline "
                                    f"(engine weight_update_timeout_s): {type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        with w.lock:
            with self._groups_lock:
                self._groups[group_name] = _Group(pg, store, rank_offset, world_size, device)
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
        device = group.device
        with broadcast_group.current(device):
            received = wire.receive(group.pg, opts, specs, load_format, screened, lambda n: w.buffer(n, device),
                                    device)
            broadcast_group.finish(device)  # the reply tells the sender its broadcast has landed
        return received
