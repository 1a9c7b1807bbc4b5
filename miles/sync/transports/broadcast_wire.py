"""The broadcast transport's wire formats: how a bucket's tensors travel as broadcasts (gloo or NCCL), the same
on the sender (broadcast.py's BroadcastTransport) and on every engine (its BroadcastReceiver).

    "flattened_small" (miles', the default)  tensors under SPLIT_BYTES are flattened together into
        uint8 broadcasts of about SPLIT_BYTES each (message_plan), and every larger tensor is
        broadcast on its own, from its own memory: each broadcast has a fixed cost, which a few large
        messages make small, while flattening tensors that are large already would cost one more
        copy for nothing. Screened for NaN/Inf by the sender as it flattens (screen.py), or by the
        engine, each message while the next arrives, when the sender does not say `screened`.
        Engines receive the flattened tensors into one buffer and stage them as views of it.
    "flattened_bucket" (SGLang's)  ONE uint8 broadcast holding every tensor's bytes in order.
    null (SGLang's)                one broadcast per tensor in its own dtype.
Non-goals: the group, the HTTP metadata and staging (broadcast.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from miles.sync import verify

if TYPE_CHECKING:
    import torch

FORMATS = ("flattened_bucket", "flattened_small", None)


# flattened_small: tensors smaller than this travel flattened together, in messages of about this
# size; each larger one goes alone, from its own memory (uncopied). Every broadcast is a gloo
# operation of its own, with a fixed cost: messages this big make it small next to the bytes, while
# the engine still screens one message for NaN/Inf as the next arrives.
SPLIT_BYTES = 32 << 20


def message_plan(sizes: list[int]) -> tuple[list[list[int]], list[int], int]:
    """How flattened_small splits a bucket of tensors of `sizes` bytes; the sender and every engine
    compute the same. Returns the messages (indices into the bucket, in sending order), each flattened
    tensor's byte offset in the flat buffer of all of them (-1 for a tensor sent alone), and that
    buffer's size. Offsets are 64-byte aligned, so each tensor is a view of the flat buffer in its
    own dtype; a flattened message is the span of the flat buffer from its first tensor to its last."""
    messages, group, offsets, size, flat = [], [], [-1] * len(sizes), 0, 0
    for i, n in enumerate(sizes):
        if n >= SPLIT_BYTES:
            messages.append([i])
            continue
        flat = (flat + 63) // 64 * 64
        offsets[i], flat = flat, flat + n
        group.append(i)
        size += n
        if size >= SPLIT_BYTES:
            messages.append(group)
            group, size = [], 0
    if group:
        messages.append(group)
    return messages, offsets, flat


def span(message: list[int], offsets: list[int], sizes: list[int]) -> tuple[int, int]:
    """The bytes of the flat buffer a flattened message covers."""
    return offsets[message[0]], offsets[message[-1]] + sizes[message[-1]]


def receive(pg, opts, specs, load_format: str | None, screened: bool, buffer: Callable[[int], "torch.Tensor"],
            device=None) -> tuple[dict[str, "torch.Tensor"], set[str] | None]:
    """An engine's receive of one bucket in `load_format` (one of FORMATS) over `pg` (broadcasts from
    rank 0 with `opts`): the tensors of `specs` ((name, dtype, shape) each), and the names among them
    holding NaN/Inf when the format screens them on arrival or the sender did (flattened_small; None
    otherwise). `buffer(nbytes)` hands out receive memory (uint8) on `device` (default: the host)."""
    import torch

    out: dict = {}
    nonfinite: set[str] | None = None  # screened names holding NaN/Inf; None: not screened yet
    if load_format == "flattened_bucket":
        nbytes = [math.prod(s) * torch.empty((), dtype=dt).element_size() for _, dt, s in specs]
        flat = torch.empty(sum(nbytes), dtype=torch.uint8, device=device)
        if flat.numel():
            pg.broadcast([flat], opts).wait()
        offset = 0
        for (name, dtype, shape), n in zip(specs, nbytes):
            chunk = flat[offset:offset + n]
            # The bucket buffer is fresh and held only by staging, so aligned chunks are staged as
            # views (no copy); viewing bytes at a misaligned offset as a wider dtype is not allowed,
            # so those few are re-based by a copy.
            if offset % torch.empty((), dtype=dtype).element_size():
                chunk = chunk.clone()
            out[name] = chunk.view(dtype).reshape(shape)
            offset += n
    elif load_format == "flattened_small":
        # The same plan as the sender's (message_plan). Every receive is queued at once (gloo
        # completes them in order), so each message is screened for NaN/Inf (unless the sender
        # did) while the ones after it are still arriving. Flattened tensors are staged as views
        # of one buffer, which the commit adopts whole, so the version after next is received
        # into the memory this one leaves.
        sizes = [math.prod(s) * torch.empty((), dtype=dt).element_size() for _, dt, s in specs]
        plan, offsets, flat_bytes = message_plan(sizes)
        flat = buffer(flat_bytes)
        bufs = []
        for message in plan:
            if offsets[message[0]] < 0:
                bufs.append(buffer(sizes[message[0]]))
            else:
                lo, hi = span(message, offsets, sizes)
                bufs.append(flat[lo:hi])
        # The sender skips empty messages (only empty tensors): so does this end.
        works = [pg.broadcast([b], opts) if b.numel() else None for b in bufs]
        nonfinite = set()
        for message, buf, work in zip(plan, bufs, works):
            if work is not None:
                work.wait()
            for i in message:
                name, dtype, shape = specs[i]
                at = offsets[i]
                data = buf if at < 0 else flat[at:at + sizes[i]]
                out[name] = data.view(dtype).reshape(shape)
                if not screened and not verify.finite(out[name]):
                    nonfinite.add(name)
        out = {name: out[name] for name, _, _ in specs}
    elif load_format is None:
        for name, dtype, shape in specs:
            t = buffer(math.prod(shape) * torch.empty((), dtype=dtype).element_size()).view(dtype).reshape(shape)
            pg.broadcast([t], opts).wait()
            out[name] = t
    else:
        raise ValueError(f"load_format: {load_format!r} is not one of {FORMATS}")
    return out, nonfinite
