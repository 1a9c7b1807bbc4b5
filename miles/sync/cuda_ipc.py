"""CUDA IPC handles as plain JSON: a trainer and an engine that share one GPU hand device memory over.

The trainer copies a bucket into a device buffer it owns and sends the buffer's IPC handle; the engine
opens the handle (the same physical memory, mapped into its own process) and copies the bucket into
its staging on the device. Weights never pass through host memory, and nothing is pickled: the
handle travels as named fields (bytes in base64), and the engine rebuilds the tensor from those
fields with torch's own rebuild function, so no code of the sender's choosing runs on the engine.

Both ends must be on the same physical GPU (its UUID travels with the handle); an engine on another
card or on the CPU is refused with the reason, and the colocated transport then sends through shared
host memory instead.
Non-goals: handles across GPUs (peer access), across hosts, or kept open past one bucket's copy.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

from miles.devices import gpu_uuid
from miles.sync.transports.base import WeightUpdateError

if TYPE_CHECKING:
    import torch

_FIELDS = ("size", "stride", "offset", "dtype", "handle", "storage_size", "storage_offset", "ref_counter_handle",
           "ref_counter_offset", "event_handle", "event_sync_required", "gpu_uuid")


def share(buf: "torch.Tensor") -> dict:
    """A JSON-able handle to `buf`'s device memory; `buf` must stay alive until the receiver has copied."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buf)
    (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    return {"size": list(size), "stride": list(stride), "offset": offset, "dtype": str(dtype).removeprefix("torch."),
            "handle": _b64(handle), "storage_size": storage_size, "storage_offset": storage_offset,
            "ref_counter_handle": _b64(ref_handle), "ref_counter_offset": ref_offset,
            "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync),
            "gpu_uuid": gpu_uuid(device)}


def open_handle(h: object, device: "torch.device") -> "torch.Tensor":
    """The sender's buffer as a tensor of this process on `device` (which must be the sender's GPU)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not isinstance(h, dict) or set(_FIELDS) - set(h):
        raise WeightUpdateError(f"ipc_handle: send an object with {', '.join(_FIELDS)} (miles.sync.cuda_ipc.share)")
    if device.type != "cuda":
        raise WeightUpdateError("load_format 'cuda_ipc': this engine computes on the CPU, so it cannot map GPU "
                                "memory; send load_format 'shm'")
    if h["gpu_uuid"] != gpu_uuid(device):
        raise WeightUpdateError(f"load_format 'cuda_ipc': the sender's GPU ({h['gpu_uuid']}) is not this engine's "
                                f"({gpu_uuid(device)}); send load_format 'shm'")
    dtype = getattr(torch, str(h["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"ipc_handle.dtype: {h['dtype']!r} is not a torch dtype")
    try:
        return rebuild_cuda_tensor(torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), int(h["offset"]),
                                   torch.storage.UntypedStorage, dtype, device.index or 0, _bytes(h["handle"]),
                                   int(h["storage_size"]), int(h["storage_offset"]), False,
                                   _bytes(h["ref_counter_handle"]), int(h["ref_counter_offset"]),
                                   _bytes(h["event_handle"]), bool(h["event_sync_required"]))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise WeightUpdateError(f"ipc_handle: the handle could not be opened ({exc}); is the sender alive?") from None


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _bytes(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)
