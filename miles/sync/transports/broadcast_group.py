"""The broadcast transport's group: which torch.distributed backend it runs on, and building it.

    gloo  every member sends and receives through host memory (gloo copies a GPU tensor through the
          host itself), so it joins any mix of cpu and cuda trainers and engines; the default on CPU.
    nccl  GPU to GPU: the trainer's source flattens each bucket into a buffer on its GPU and every
          engine receives into a buffer on its own, with no copy through host memory. Every member
          must compute on a GPU of its own: NCCL refuses two ranks of one group on the same GPU.

`sync.backend = "auto"` picks nccl when the trainer's source and every engine compute on cuda, each
on a GPU of its own (as /get_server_info's `device` and `gpu_uuid` say), and gloo otherwise; an
explicit "nccl" that cannot run is refused at connect with the reason and what to set instead
(`choose`). Engines sharing the trainer's GPU take weights over CUDA IPC: sync.transport = "colocated".

The group is built from the members' TCPStore without init_process_group (a trainer's own default
group is neither used nor disturbed). It lays its keys out in the store as SGLang's
`init_custom_process_group` does (the group's name twice, then the device), so a plain SGLang server
joins it with its own /init_weights_update_group, and a trainer built on that helper joins a miles
engine's.
Non-goals: the messages and their formats (broadcast_wire.py), the HTTP side (broadcast.py).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.sync.transports.base import TransportError

if TYPE_CHECKING:
    import torch

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Member:
    """Where one member of the group computes: `device` "cpu" or "cuda" (None: not said, as by an
    engine too old to report it) and the physical GPU's uuid when known."""

    name: str
    device: str | None
    gpu: str | None = None


def engine_member(url: str, info: dict) -> Member:
    """An engine as its /get_server_info describes it (miles' engines report `device` and `gpu_uuid`;
    SGLang's report `device` among their server arguments)."""
    device = str(info.get("device") or "") or None
    return Member(url, device.split(":")[0] if device else None, info.get("gpu_uuid") or None)


def engine_ranks(infos: list[dict]) -> tuple[list[int], int]:
    """Each engine's first rank in the group (its rank_offset) and the group's size. An SGLang server
    joins with one rank per tensor-parallel rank (rank_offset + tp_rank, its /get_server_info says
    tp_size); the built-in engine with one."""
    offsets, rank = [], 1  # rank 0: the trainer's source
    for info in infos:
        offsets.append(rank)
        rank += max(1, int(info.get("tp_size") or 1))
    return offsets, rank


def choose(backend: str, source: Member, engines: list[Member]) -> str:
    """The backend the group runs on: gloo or nccl. `backend` is sync.backend (auto, gloo, nccl);
    `source` the trainer's sending rank. Raises TransportError naming the fix when nccl cannot run."""
    if backend not in BACKENDS:
        raise TransportError(f"sync.backend = {backend!r}: choose auto (nccl when the trainer and every engine "
                             "compute on GPUs of their own, else gloo), gloo or nccl")
    if backend == "gloo":
        return "gloo"
    why = _why_not_nccl(source, engines)
    if backend == "auto":
        return "gloo" if why else "nccl"
    if why:
        raise TransportError(f"sync.backend = 'nccl' cannot run: {why}")
    return "nccl"


def _why_not_nccl(source: Member, engines: list[Member]) -> str | None:
    if source.device != "cuda":
        return (f"the trainer's source rank computes on {source.device or 'an unknown device'}, and NCCL moves "
                "GPU memory only; set trainer.device = 'cuda', or sync.backend = 'gloo' (or 'auto')")
    off_gpu = [m.name for m in engines if m.device != "cuda"]
    if off_gpu:
        return (f"engine(s) {off_gpu} are not on a GPU by their /get_server_info `device` (NCCL moves GPU "
                "memory only, and every member of the group must be on one); put every engine on cuda "
                "(rollout.engine.device = 'cuda'), or set sync.backend = 'gloo' (or 'auto'), which joins cpu "
                "and cuda members alike")
    seen: dict[str, str] = {}
    for m in [source, *engines]:
        if m.gpu is None:
            continue  # not said (an SGLang server): NCCL itself refuses a duplicate at the first broadcast
        if m.gpu in seen:
            return (f"{seen[m.gpu]} and {m.name} compute on the same GPU ({m.gpu}), and NCCL refuses two ranks "
                    "of one group on one GPU; engines that share the trainer's GPU take weights over CUDA IPC "
                    "with sync.transport = 'colocated', or give each engine a GPU of its own, or set "
                    "sync.backend = 'gloo' (through host memory)")
        seen[m.gpu] = m.name
    return None


def build(store, group_name: str, rank: int, world_size: int, backend: str, timeout: datetime.timedelta):
    """This member's end of the group (rank `rank` of `world_size`) over `store`, the TCPStore rank 0
    hosts. Joining blocks until every member has joined (gloo) or, for nccl, returns at once: NCCL
    connects at the group's first broadcast, which every member makes."""
    import torch.distributed as dist

    # SGLang's init_custom_process_group keys a group by its name, then torch's per-group "name/" and
    # per-device prefix: "cpu/" for gloo (one gloo context serves both devices), "cuda/" for nccl.
    named = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    if backend == "gloo":
        return dist.ProcessGroupGloo(dist.PrefixStore("cpu/", named), rank, world_size, timeout)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("this torch has no NCCL (a CPU-only build): set sync.backend = 'gloo'")
        prefixed = dist.PrefixStore("cuda/", named)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        with _env(NCCL_ON_TIMEOUT):
            return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    raise ValueError(f"backend {backend!r}: use 'gloo' or 'nccl'")


NCCL_ON_TIMEOUT = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
"""How this group's NCCL meets a dead or late member, read by torch when the group is built: a wait
blocks and raises at the deadline (so a push fails like one on gloo), and the communicator is torn
down without ending the process (torch's default would end the engine or the trainer)."""


@contextlib.contextmanager
def _env(values: dict[str, str]):
    """`values` in the environment while the group is built, where the user has not set them."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def finish(device: "torch.device") -> None:
    """Wait until the collectives queued on `device` have completed: NCCL's work.wait() only orders
    the current CUDA stream after them, and a reply must mean the bytes are in place."""
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def current(device) -> contextlib.AbstractContextManager:
    """`device` made current for this thread's CUDA calls (NCCL binds its communicator to the device
    current at the first broadcast); nothing on cpu."""
    import torch

    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def explained(backend: str | None):
    """NCCL's own refusal of two ranks on one GPU (met at the first broadcast, where a member did not
    say its GPU, as a plain SGLang server does not) re-raised with what to do instead."""
    try:
        yield
    except Exception as exc:
        if backend == "nccl" and "duplicate gpu" in str(exc).lower():
            raise RuntimeError(f"{exc}: NCCL refuses two ranks of one group on one GPU; engines that share the "
                               "trainer's GPU take weights over CUDA IPC with sync.transport = 'colocated', or set "
                               "sync.backend = 'gloo'") from exc
        raise
