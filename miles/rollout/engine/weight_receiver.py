"""The engine's end of distributed weight updates: join a trainer's group, receive, stage, apply.

Wire contract (SGLang's `update_weights_from_distributed`, plus miles' staging):
  * `init_group` joins a stand-alone gloo group whose rank 0 (the trainer's source) hosts the TCPStore.
    The default process group is never created or touched, so an engine can share a process with
    other torch.distributed users and a trainer can keep its own FSDP group.
  * `receive` first completes the broadcast(s) - always, even when the metadata is wrong, so every
    member of the collective stays in step - then validates names/shapes against the model and puts
    the tensors into staging. Any error discards the whole staging and poisons the pending version:
    its commit is refused, because applying the remainder would publish a version that never existed.
  * `commit` applies all staged tensors in one go under the engine's model lock (between two decode
    steps), sets the weight version, and clears staging.
  * `reset_staging` (a miles extension, sent with the first bucket of each version) drops whatever an
    abandoned earlier version left staged or poisoned, so one failed push does not block the next.
Two wire formats: load_format "flattened_bucket" = ONE uint8 broadcast holding every tensor's bytes
in order (sum of numel * itemsize); load_format None = one broadcast per tensor in its own dtype.
Non-goals: NCCL/CUDA (the built-in engine is CPU-only), tensor-parallel resharding on receive.
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass

import torch

from miles.rollout.engine.types import InvalidRequest

log = logging.getLogger(__name__)


class WeightUpdateError(InvalidRequest):
    """A weight update the engine refused; the old weights stay in force (HTTP 400)."""


@dataclass
class _Group:
    pg: object  # torch.distributed.ProcessGroupGloo
    store: object  # keeps the TCPStore client alive as long as the group
    rank: int
    world_size: int


class WeightReceiver:
    def __init__(self, engine, timeout_s: float = 120.0):
        self.engine = engine
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._groups: dict[str, _Group] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._poisoned: str | None = None  # why the pending version can no longer be committed
        self._lock = threading.Lock()  # one update at a time: collectives must not interleave

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str = "weight_update_group", backend: str = "gloo") -> str:
        import torch.distributed as dist

        if backend != "gloo":
            raise WeightUpdateError(f"backend: the built-in engine runs on CPU and only supports 'gloo', "
                                    f"got {backend!r}")
        if not 1 <= rank_offset < world_size:
            raise WeightUpdateError(f"rank_offset: {rank_offset} must be in [1, world_size={world_size}); "
                                    "rank 0 is the trainer's source")
        with self._lock:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=self.timeout)
            # The prefix keeps several groups (or a re-initialised one) from colliding in one store.
            pg = dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank_offset, world_size, self.timeout)
            self._groups[group_name] = _Group(pg, store, rank_offset, world_size)
            self._staging.clear()
            self._poisoned = None
        return f"joined {group_name!r} as rank {rank_offset} of {world_size}"

    def destroy_group(self, group_name: str) -> None:
        with self._lock:
            self._groups.pop(group_name, None)

    def reset_staging(self) -> None:
        with self._lock:
            self._staging.clear()
            self._poisoned = None

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                group_name: str = "weight_update_group", load_format: str | None = None) -> None:
        """Receive one bucket into staging; raises WeightUpdateError (staging discarded) on bad data."""
        if not names:
            return
        with self._lock:
            group = self._groups.get(group_name)
            if group is None:
                raise WeightUpdateError(f"group_name: no weight-update group {group_name!r}; call "
                                        "/init_weights_update_group first")
            # Without dtypes and shapes the receive cannot be sized, so the sender's broadcast will
            # time out: nothing better can be done than refusing at once.
            if not len(names) == len(dtypes) == len(shapes):
                raise self._fail(f"names, dtypes and shapes must have equal lengths, got "
                                 f"{len(names)}, {len(dtypes)}, {len(shapes)}")
            specs = []
            for name, dt, shape in zip(names, dtypes, shapes):
                dtype = _parse_dtype(dt)
                if dtype is None:
                    raise self._fail(f"dtypes: {dt!r} (tensor {name!r}) is not a torch dtype")
                if any(not isinstance(d, int) or d < 0 for d in shape):
                    raise self._fail(f"shapes: {shape!r} (tensor {name!r}) is not a list of non-negative ints")
                specs.append((name, dtype, tuple(shape)))

            try:
                received = self._broadcast(group, specs, load_format)
            except WeightUpdateError:
                raise
            except Exception as exc:  # noqa: BLE001 - a dead or late peer; the group is unusable now
                self._groups.pop(group_name, None)
                raise self._fail(f"receiving from group {group_name!r} failed ({exc}); re-initialise the "
                                 "group with /init_weights_update_group") from None
            err = self._validate(received)
            if err is not None:
                raise self._fail(err)
            self._staging.update(received)

    def commit(self, weight_version: int | None, flush_cache: bool = True) -> int:
        with self._lock:
            if self._poisoned is not None:
                why, self._poisoned = self._poisoned, None
                self._staging.clear()
                raise WeightUpdateError(f"commit refused: an earlier bucket of this version failed ({why}); "
                                        "the old weights stay in force, resend the whole version")
            staged, self._staging = self._staging, {}
            version = self.engine.apply_weights(staged, weight_version)
            if flush_cache:
                self.engine.flush_cache()
            return version

    @property
    def staged_names(self) -> list[str]:
        return list(self._staging)

    def _broadcast(self, group: _Group, specs, load_format: str | None) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        out: dict[str, torch.Tensor] = {}
        if load_format == "flattened_bucket":
            nbytes = [_numel(s) * torch.empty((), dtype=dt).element_size() for _, dt, s in specs]
            flat = torch.empty(sum(nbytes), dtype=torch.uint8)
            if flat.numel():
                group.pg.broadcast([flat], opts).wait()
            offset = 0
            for (name, dtype, shape), n in zip(specs, nbytes):
                # clone() re-bases each chunk at offset 0: viewing bytes at an odd offset as a wider
                # dtype is not allowed, and staging must not pin the whole bucket anyway.
                out[name] = flat[offset:offset + n].clone().view(dtype).reshape(shape)
                offset += n
        elif load_format is None:
            for name, dtype, shape in specs:
                t = torch.empty(shape, dtype=dtype)
                group.pg.broadcast([t], opts).wait()
                out[name] = t
        else:
            raise self._fail(f"load_format: {load_format!r} is not supported; use 'flattened_bucket' or null")
        return out

    def _validate(self, received: dict[str, torch.Tensor]) -> str | None:
        meta = self.engine.param_meta
        for name, t in received.items():
            if name not in meta:
                return f"tensor {name!r} is not a parameter of the served model"
            shape, _ = meta[name]
            if tuple(t.shape) != shape:
                return f"tensor {name!r} has shape {list(t.shape)} but the model expects {list(shape)}"
            if t.is_floating_point() and not torch.isfinite(t).all():
                return f"tensor {name!r} contains NaN or Inf"
        return None

    def _fail(self, reason: str) -> WeightUpdateError:
        self._staging.clear()
        self._poisoned = reason
        return WeightUpdateError(reason + "; staged weights were discarded")


def _parse_dtype(name) -> torch.dtype | None:
    if not isinstance(name, str):
        return None
    dt = getattr(torch, name.removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
