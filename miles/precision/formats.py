"""Low-precision number formats, bit-exact: what a value becomes when stored in one.

A *format* is an element type (how one number is stored), a block shape (which numbers share one
scale) and a scale type (how that scale is stored):

| name          | elements         | block            | scale                                   |
|---------------|------------------|------------------|-----------------------------------------|
| `fp8`         | FP8 E4M3         | 128 × 128        | FP32, amax / 448 (DeepSeek-V3 style)    |
| `fp8_tensor`  | FP8 E4M3         | the whole tensor | FP32, amax / 448                        |
| `fp8_e5m2`    | FP8 E5M2         | 128 × 128        | FP32, amax / 57344                      |
| `fp8_e5m2_tensor` | FP8 E5M2     | the whole tensor | FP32, amax / 57344                      |
| `mxfp8`       | FP8 E4M3         | 1 × 32           | E8M0, 2^(floor(log2 amax) − 8) (OCP MX v1.0) |
| `nvfp4`       | FP4 E2M1         | 1 × 16           | E4M3 per block × one FP32 per tensor    |
| `int4`        | INT4, symmetric  | 1 × 128          | FP32, amax / 7                          |
| `int4_asym`   | UINT4 + zero point | 1 × 128        | FP32, (max − min) / 15, uint8 zero point |

Blocks run along the last dimension (the reduction dimension of a Linear weight); a tensor is seen
as 2-D (rows = everything but the last dimension). Where a side is not a whole number of blocks, the
last block overhangs the edge: it is scaled as if padded with zeros (which never change its amax),
and only the real elements are stored.

Conventions shared by every format (each one has a test in tests/unit/precision/test_formats.py):
- element conversion rounds to nearest, ties to even, and *saturates*: a finite value beyond the
  element's largest magnitude, and ±Inf, become ±max (the OCP "satfinite" mode). torch's own cast
  does this for E4M3 but overflows to Inf for E5M2, hence the clamp before it;
- a block holding NaN or ±Inf gets a NaN scale, so its whole dequantization is NaN: a non-finite
  weight is never silently turned into a finite one;
- an all-zero block gets a unit scale (MXFP8: the smallest E8M0 scale, 2^-127) and all-zero elements.

Storage uses torch's dtypes (`float8_e4m3fn`, `float8_e5m2`, `float8_e8m0fnu`, `float4_e2m1fn_x2`);
the scaling, the E2M1 rounding and the packing of two 4-bit values per byte (the first value of a
pair in the low nibble) are ours, since torch has no cast to 4-bit types.

Non-goals: fast kernels (dequantize-then-matmul is emulation: the numerics of a low-precision
matmul with a float32 accumulator, none of its speed), activation quantization, formats other than
these.
"""

from __future__ import annotations

import torch

from miles.precision.types import FORMATS, Format, QuantizedTensor, get_format

__all__ = ["FORMATS", "Format", "QuantizedTensor", "get_format", "quantize", "dequantize", "fake_quantize"]

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0
MX_E4M3_EMAX = 8  # the exponent of E4M3's largest normal, 448 = 1.75 · 2^8 (the spec's emax_elem)
E8M0_BIAS = 127
E8M0_NAN = 0xFF

# E2M1's eight magnitudes, indexed by their 3-bit code (exponent bits, then the mantissa bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes: a value on one rounds to the neighbour with an even code.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ---- element conversions (no scaling) ---------------------------------------------------------

def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float → float8_e4m3fn, ties to even, saturating (±Inf → ±448, NaN stays NaN)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def to_e5m2(x: torch.Tensor) -> torch.Tensor:
    """float → float8_e5m2, ties to even, saturating (torch alone would overflow to Inf)."""
    return x.float().clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float → 4-bit E2M1 codes (uint8, sign in bit 3), ties to even, saturating at ±6; NaN → +0."""
    x = x.float()
    mag = torch.nan_to_num(x.abs(), nan=0.0)
    mids = torch.tensor(_E2M1_MIDPOINTS, device=x.device)
    code = torch.bucketize(mag, mids)  # a value equal to a midpoint gets the lower neighbour's code
    tie_to_odd = (code < len(_E2M1_MIDPOINTS)) & (mids[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)] == mag) \
        & (code % 2 == 1)
    code = code + tie_to_odd.long()  # ... unless that code is odd: then the upper one, which is even
    sign = torch.signbit(x) & ~torch.isnan(x)
    return (code | (sign.long() << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes → float32."""
    table = torch.tensor(E2M1_VALUES, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) 4-bit codes → (..., n) bytes; the first of each pair in the low nibble."""
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes → (..., 2n) 4-bit codes (uint8), low nibble first."""
    packed = packed.view(torch.uint8)
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def e8m0_from_exponent(e: torch.Tensor, nan: torch.Tensor) -> torch.Tensor:
    """Unbiased exponents (clamped to E8M0's range −127..127) → float8_e8m0fnu; `nan` marks NaN scales."""
    biased = (e.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    biased = torch.where(nan, torch.full_like(biased, E8M0_NAN), biased)
    return biased.view(torch.float8_e8m0fnu)


# ---- blocks -------------------------------------------------------------------------------------

def _as_blocks(x: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """x → (block rows, rows per block, block cols, cols per block), zero-padded to whole blocks."""
    x2 = x.float().reshape(1, -1) if x.dim() < 2 else x.float().reshape(-1, x.shape[-1])
    rows, cols = x2.shape
    br, bc = block if block is not None else (rows, cols)
    br, bc = max(br, 1), max(bc, 1)
    pad_r, pad_c = -rows % br, -cols % bc
    if pad_r or pad_c:
        x2 = torch.nn.functional.pad(x2, (0, pad_c, 0, pad_r))
    return x2.reshape(x2.shape[0] // br, br, x2.shape[1] // bc, bc)


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view of a shape: (product of all but the last dimension, last dimension)."""
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows, (shape[-1] if shape else 1)


def _crop(xb: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Blocks → the 2-D view of `shape`, without the overhang. (rows, cols)"""
    nbr, br, nbc, bc = xb.shape
    rows, cols = _rows_cols(shape)
    return xb.reshape(nbr * br, nbc * bc)[:rows, :cols]


def _amax(xb: torch.Tensor) -> torch.Tensor:
    """Per block max |x| (NaN if the block holds a NaN). (block rows, 1, block cols, 1)"""
    a = xb.abs().amax(dim=(1, 3), keepdim=True)
    has_nan = torch.isnan(xb).any(dim=3, keepdim=True).any(dim=1, keepdim=True)
    return torch.where(has_nan, torch.full_like(a, float("nan")), a)


def _linear_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """amax / top; 1 for an all-zero block, NaN for a non-finite one."""
    scale = amax / top
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """(rows, cols) codes → (rows, ceil(cols / 2)) bytes; an odd last column pairs with a zero code."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return pack_nibbles(codes)


def _scale_grid(scales: torch.Tensor) -> torch.Tensor:
    """Stored (block rows, block cols) scales → (block rows, 1, block cols, 1) for broadcasting."""
    return scales.reshape(scales.shape[0], 1, scales.shape[1], 1)


# ---- quantize / dequantize -----------------------------------------------------------------------

def quantize(x: torch.Tensor, fmt: Format | str) -> QuantizedTensor:
    """Store `x` in `fmt`. Deterministic: the same tensor always gives the same bytes."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    shape = tuple(x.shape)
    xb = _as_blocks(x.detach(), fmt.block)  # (nbr, br, nbc, bc) float32
    amax = _amax(xb)
    finite = torch.isfinite(amax)
    grid = (xb.shape[0], xb.shape[2])

    if fmt.element in ("e4m3", "e5m2") and fmt.scale == "fp32":
        top, cast = (E4M3_MAX, to_e4m3) if fmt.element == "e4m3" else (E5M2_MAX, to_e5m2)
        scale = _linear_scale(amax, top)
        data = cast(_crop(xb / scale, shape))
        return QuantizedTensor(fmt, data, scale.reshape(grid), shape)

    if fmt.scale == "e8m0":  # MXFP8, OCP Microscaling v1.0 §6.3
        # floor(log2(amax)) exactly: frexp gives amax = m · 2^k with m in [0.5, 1), so it is k − 1.
        _, k = torch.frexp(torch.where(finite & (amax > 0), amax, torch.ones_like(amax)))
        e = torch.where(amax > 0, (k - 1) - MX_E4M3_EMAX, torch.full_like(k, -E8M0_BIAS))
        e = e.clamp(-E8M0_BIAS, E8M0_BIAS)
        # Scaling by a power of two is exact; values above 448 · 2^e (the spec's choice of scale lets
        # the block's largest values reach almost 512 · 2^e) saturate to 448.
        scaled = torch.where(finite, torch.ldexp(xb, -e.float()), torch.zeros_like(xb))
        data = to_e4m3(_crop(scaled, shape))
        return QuantizedTensor(fmt, data, e8m0_from_exponent(e, ~finite).reshape(grid), shape)

    if fmt.scale == "e4m3_fp32":  # NVFP4
        # One FP32 scale maps the tensor's amax onto the largest block scale times the largest element,
        # so block scales use E4M3's whole range: amax_t = 448 · 6 · tensor_scale.
        t_amax = _amax(xb.reshape(1, -1, 1, 1))
        tensor_scale = _linear_scale(t_amax, E4M3_MAX * E2M1_MAX).reshape(())
        block_scale = to_e4m3(amax / E2M1_MAX / tensor_scale)  # a NaN block stays NaN
        step = block_scale.float() * tensor_scale  # the real value of one element unit in each block
        # A block whose scale is 0 (all zeros, or so small next to the tensor's amax that its E4M3 scale
        # underflows) stores zeros.
        safe = torch.where(step > 0, step, torch.ones_like(step))
        codes = torch.where(step > 0, e2m1_codes(xb / safe), torch.zeros_like(xb, dtype=torch.uint8))
        data = _pack(_crop(codes, shape)).view(torch.float4_e2m1fn_x2)
        return QuantizedTensor(fmt, data, block_scale.reshape(grid), shape, tensor_scale=tensor_scale)

    if fmt.element == "int4":
        scale = _linear_scale(amax, 7.0)
        q = torch.round(torch.where(finite, xb / scale, torch.zeros_like(xb))).clamp(-8, 7)  # half to even
        data = _pack(_crop(q.to(torch.int16) & 0xF, shape))
        return QuantizedTensor(fmt, data, scale.reshape(grid), shape)

    if fmt.element == "uint4":
        # The range always holds 0, so 0 is exact (padding, pruned weights) and the zero point is an integer.
        lo = xb.amin(dim=(1, 3), keepdim=True).clamp(max=0)
        hi = xb.amax(dim=(1, 3), keepdim=True).clamp(min=0)
        scale = _linear_scale(torch.where(finite, hi - lo, amax), 15.0)
        zero = torch.where(finite, torch.round(-lo / scale), torch.zeros_like(lo)).clamp(0, 15)
        q = torch.round(torch.where(finite, xb / scale, torch.zeros_like(xb))) + zero
        data = _pack(_crop(q.clamp(0, 15).to(torch.uint8), shape))
        return QuantizedTensor(fmt, data, scale.reshape(grid), shape,
                               zero_points=zero.to(torch.uint8).reshape(grid))

    raise ValueError(f"format {fmt.name!r}: no quantizer for element {fmt.element!r} with scale {fmt.scale!r}")


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """The float32 tensor `q` stands for, in its original shape."""
    fmt = q.format
    _, cols = _rows_cols(q.shape)
    if fmt.bits == 4:
        codes = unpack_nibbles(q.data)[:, :cols]  # (rows, cols)
    if fmt.element in ("e4m3", "e5m2"):
        values, step = q.data.float(), q.scales.float()  # e8m0 → float32 is exact (2^-127 … 2^127, NaN)
    elif fmt.element == "e2m1":
        values, step = e2m1_values(codes), q.scales.float() * q.tensor_scale
    elif fmt.element == "int4":
        signed = codes.to(torch.int16)
        values, step = torch.where(signed >= 8, signed - 16, signed).float(), q.scales  # two's complement
    else:
        values, step = codes.float(), q.scales
    xb = _as_blocks(values, fmt.block)
    if fmt.element == "uint4":
        xb = xb - _scale_grid(q.zero_points.float())
    return _crop(xb * _scale_grid(step), q.shape).reshape(q.shape)


# ---- fake quantization for training -------------------------------------------------------------

class _StraightThrough(torch.autograd.Function):
    """Forward: the value the format stores. Backward: the gradient passes unchanged (straight-through
    estimator), so the full-precision master weight keeps learning below the format's resolution."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: Format) -> torch.Tensor:
        return dequantize(quantize(x, fmt)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fake_quantize(x: torch.Tensor, fmt: Format | str) -> torch.Tensor:
    """quantize-then-dequantize, in x's dtype, with a straight-through gradient. The forward value
    equals `dequantize(quantize(x, fmt)).to(x.dtype)` exactly (not x + (q − x), which rounds)."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    return _StraightThrough.apply(x, fmt)
