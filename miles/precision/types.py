"""The low-precision formats by name, and the container a quantized tensor travels in.

Loading this imports no torch (config validation reads the names); the arithmetic is in formats.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Element = Literal["e4m3", "e5m2", "e2m1", "int4", "uint4"]
ScaleKind = Literal["fp32", "e8m0", "e4m3_fp32"]


@dataclass(frozen=True)
class Format:
    """How a tensor is stored: element type, which elements share a scale, and the scale's type."""

    name: str
    element: Element
    block: tuple[int, int] | None
    """(rows, columns) of one scaled block; None = one scale for the whole tensor."""
    scale: ScaleKind

    @property
    def bits(self) -> int:
        """Bits of one element."""
        return 4 if self.element in ("e2m1", "int4", "uint4") else 8


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("fp8", "e4m3", (128, 128), "fp32"),
    Format("fp8_tensor", "e4m3", None, "fp32"),
    Format("fp8_e5m2", "e5m2", (128, 128), "fp32"),
    Format("fp8_e5m2_tensor", "e5m2", None, "fp32"),
    Format("mxfp8", "e4m3", (1, 32), "e8m0"),
    Format("nvfp4", "e2m1", (1, 16), "e4m3_fp32"),
    Format("int4", "int4", (1, 128), "fp32"),
    Format("int4_asym", "uint4", (1, 128), "fp32"),
)}


def get_format(name: str, key: str = "quantization") -> Format:
    """The format called `name`; a ValueError naming `key` and the choices otherwise."""
    if name not in FORMATS:
        raise ValueError(f"{key} = {name!r} is not a format; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor in a low-precision format: its elements, one scale per block, and its true shape."""

    format: Format
    data: torch.Tensor
    """Elements of the tensor seen as 2-D: float8 (rows, cols), or 4-bit pairs packed in bytes
    (rows, ceil(cols / 2)). Blocks may overhang the tensor's edge; the overhang is not stored."""
    scales: torch.Tensor
    """One per block (block rows, block cols): float32, float8_e8m0fnu or float8_e4m3fn."""
    shape: tuple[int, ...]
    """The original shape (before flattening to 2-D)."""
    tensor_scale: torch.Tensor | None = None
    """NVFP4's FP32 per-tensor scale (a 0-d tensor); None for the other formats."""
    zero_points: torch.Tensor | None = None
    """INT4 asymmetric: one uint8 zero point per block; None otherwise."""

    @property
    def nbytes(self) -> int:
        """Bytes of everything stored: elements, scales, per-tensor scale and zero points."""
        parts = [self.data, self.scales, self.tensor_scale, self.zero_points]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)
