"""Quantized weights on the wire: a weight as its format stores it, packed into one byte tensor.

When an engine serves a weight in a format (rollout.engine.quantization), weight sync sends that
weight as the format's bytes instead of its full-precision values: the trainer quantizes it during
preparation (exactly as the engine would quantize the tensor it received), and the bucket carries

    (wire_name(name, format), payload)   payload: a 1-D uint8 tensor

where the payload of one matrix is its elements, then its scales, then NVFP4's per-tensor scale or
INT4-asym's zero points, each as its raw bytes; a 3-D (MoE experts) weight is quantized one matrix
at a time and its payload is the matrices' payloads in order. Every byte layout follows from the
weight's shape and the format, so nothing else travels. Any transport moves it as it moves any uint8
tensor, and disk-delta XORs these bytes against the previous version's, so only changed quantized
bytes travel.

The engine installs the received bytes as its stored copy of the weight without quantizing again,
and holds their dequantized values (in its dtype) as the parameter, so noise fills and checksums keep
working on full tensors. Since quantize() is deterministic, those bytes are the bytes the engine
would have made from a full-precision push: the served policy is the same, bit for bit.

Non-goals: quantizing anything the engine serves in full precision (it never asks for it), and
storing a format's bytes in checkpoints.
"""

from __future__ import annotations

import functools

import torch

from miles.precision.formats import Format, QuantizedTensor, dequantize, get_format, quantize

SEP = "@"  # wire name = "<parameter name>@<format>"; parameter names never hold it


def wire_name(name: str, fmt: Format) -> str:
    """The name a quantized weight travels under."""
    return f"{name}{SEP}{fmt.name}"


def split_name(name: str) -> tuple[str, str] | None:
    """(parameter name, format name) of a wire name, or None for a full-precision tensor's name."""
    base, sep, fmt = name.rpartition(SEP)
    return (base, fmt) if sep and base else None


def _parts(q: QuantizedTensor) -> list[torch.Tensor]:
    return [t for t in (q.data, q.scales, q.tensor_scale, q.zero_points) if t is not None]


@functools.lru_cache(maxsize=512)
def _layout(shape: tuple[int, ...], fmt_name: str) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
    """(dtype, shape) of each stored part of one matrix of `shape` in the format."""
    return tuple((t.dtype, tuple(t.shape)) for t in _parts(quantize(torch.zeros(shape), fmt_name)))


def _matrices(shape: tuple[int, ...], per_matrix: bool) -> tuple[int, tuple[int, ...]]:
    return (shape[0], shape[1:]) if per_matrix else (1, shape)


def payload_nbytes(shape: tuple[int, ...], fmt: Format, per_matrix: bool) -> int:
    """Bytes of the payload of a weight of `shape` (the quantized size: elements + scales)."""
    n, mshape = _matrices(tuple(shape), per_matrix)
    return n * sum(dt.itemsize * _numel(s) for dt, s in _layout(mshape, fmt.name))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def encode(weight: torch.Tensor, fmt: Format, per_matrix: bool) -> tuple[torch.Tensor, list[QuantizedTensor]]:
    """(payload, the stored matrices) of `weight` in `fmt`; `per_matrix`: each w[i] of a 3-D weight alone."""
    w = weight.detach()
    stored = [quantize(m, fmt) for m in w] if per_matrix else [quantize(w, fmt)]
    payload = torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for q in stored for p in _parts(q)])
    return payload, stored


def decode(payload: torch.Tensor, shape: tuple[int, ...], fmt: Format | str,
           per_matrix: bool) -> list[QuantizedTensor]:
    """The stored matrices a payload holds; ValueError if its size is not the format's for `shape`."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    shape = tuple(shape)
    expected = payload_nbytes(shape, fmt, per_matrix)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
        raise ValueError(f"a {fmt.name} payload of a {list(shape)} weight is {expected} uint8 bytes in one "
                         f"dimension, got {payload.dtype} of shape {list(payload.shape)}")
    n, mshape = _matrices(shape, per_matrix)
    layout = _layout(mshape, fmt.name)
    stored, at = [], 0
    flat = payload.contiguous()
    for _ in range(n):
        parts = []
        for dt, s in layout:
            size = dt.itemsize * _numel(s)
            parts.append(flat[at:at + size].clone().view(dt).reshape(s))
            at += size
        data, scales, *rest = parts
        tensor_scale = rest.pop(0).reshape(()) if fmt.scale == "e4m3_fp32" else None
        zero_points = rest.pop(0) if fmt.element == "uint4" else None
        stored.append(QuantizedTensor(fmt, data, scales, mshape, tensor_scale=tensor_scale, zero_points=zero_points))
    return stored


def values(stored: list[QuantizedTensor], dtype: torch.dtype, per_matrix: bool) -> torch.Tensor:
    """The dequantized weight in `dtype`: what a serving layer computes with (linear.StoredWeight)."""
    out = [dequantize(q) for q in stored]
    return (torch.stack(out) if per_matrix else out[0]).to(dtype)


def from_base(tensors: dict, name: str) -> torch.Tensor | None:
    """`tensors[name]`; for a wire name, the payload of that weight as `tensors` holds it (added to
    `tensors`), so that a disk delta of quantized bytes has a base both ends compute alike. None if absent."""
    if name in tensors:
        return tensors[name]
    split = split_name(name)
    if split is None or split[0] not in tensors:
        return None
    weight = tensors[split[0]]
    tensors[name] = encode(weight, get_format(split[1]), weight.dim() == 3)[0]
    return tensors[name]
