"""Linear layers that compute with their weight as a low-precision format stores it.

`quantize_linears(model, name, mode)` swaps a model's `nn.Linear` layers for `QuantizedLinear`s that
share the same Parameter objects (names, state dicts, optimizers and FSDP see nothing new):

- `mode="train"` (QAT): every forward uses `fake_quantize(weight)`: the value the format stores, with
  a straight-through gradient into the float32 master weight. The trained policy is the quantized one.
- `mode="serve"` (an engine): the layer keeps the weight in the format (a `QuantizedTensor`, made
  again whenever the weight changes) and dequantizes it in each matmul. It still holds the full
  weight it received, because weight updates, noise fills and checksums work on that tensor.

Both modes run `dequantize(quantize(w))` on the same weight, so a trainer and an engine holding the same
float32 weights compute the same logits. The embeddings, the LM head and MoE routers stay in full
precision (as DeepSeek-V3's FP8 recipe and NVFP4/MXFP8 checkpoints leave them), as do activations.

Non-goals: low-precision matmul kernels (this is emulation: the numerics, none of the speed), and
quantizing anything but Linear weights.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from miles.models.moe import routers
from miles.precision.formats import Format, QuantizedTensor, dequantize, fake_quantize, get_format, quantize

Mode = Literal["train", "serve"]

# Linear layers left in full precision: the output head (its logits are what RL measures) and, by
# identity, MoE routers (a flipped top-k choice costs far more than the bytes saved).
_KEEP = ("lm_head",)


class QuantizedLinear(torch.nn.Linear):
    """nn.Linear whose matmul uses its weight as stored in `fmt`."""

    def __init__(self, linear: torch.nn.Linear, fmt: Format, mode: Mode):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: nothing is copied
        self.fmt, self.mode = fmt, mode
        self._stored: tuple[tuple[int, int], QuantizedTensor] | None = None

    def effective_weight(self) -> torch.Tensor:
        """The weight the matmul uses: the format's value of the current weight, in its dtype."""
        if self.mode == "train":
            return fake_quantize(self.weight, self.fmt)
        return dequantize(self.stored()).to(self.weight.dtype)

    def stored(self) -> QuantizedTensor:
        """The weight in the format, made again only when the weight's memory or contents changed."""
        w = self.weight.detach()
        try:
            key = (w.data_ptr(), w._version)  # a copy_ into it bumps _version; a swapped .data moves data_ptr
        except RuntimeError:  # an inference tensor keeps no version counter: a cached copy could be stale
            return quantize(w, self.fmt)
        if self._stored is None or self._stored[0] != key:
            self._stored = (key, quantize(w, self.fmt))
        return self._stored[1]

    def drop_stored(self) -> None:
        """Free the quantized copy (the weights were released); the next forward makes it again."""
        self._stored = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.effective_weight(), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", format={self.fmt.name}, mode={self.mode}"


def quantize_linears(model: torch.nn.Module, name: str, mode: Mode, key: str = "quantization") -> list[str]:
    """Swap every Linear of `model` but the LM head and MoE routers for a QuantizedLinear in format
    `name` ("none" leaves the model alone). Returns the swapped layers' names."""
    if name == "none":
        return []
    fmt = get_format(name, key)
    keep = {id(r) for r in routers(model)} if hasattr(model, "config") else set()  # HF models only
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is not torch.nn.Linear or id(child) in keep or child_name in _KEEP:
                continue
            setattr(parent, child_name, QuantizedLinear(child, fmt, mode))
            swapped.append(full)
    if not swapped:
        raise ValueError(f"{key} = {name!r}: {type(model).__name__} has no Linear layer to quantize")
    return swapped


def drop_stored(model: torch.nn.Module) -> None:
    """Free every QuantizedLinear's quantized copy of its weight (an engine releasing its memory)."""
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.drop_stored()
