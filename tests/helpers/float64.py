"""transformers' models computed wholly in float64, for tests that tell what a computation computes apart
from how float32 rounds it.

A model converted with `.double()` still rounds to float32 where transformers casts on purpose: norms,
routers, the gated delta rule and the Mamba-2 scan (`.float()`, `.to(torch.float32)`,
`.type(torch.float32)`, `softmax(..., dtype=torch.float32)`). Inside `float32_casts_stay_float64()` such a
cast of a float64 tensor leaves it float64 (casts of other dtypes are untouched), so every step of the
model runs in float64. Process-wide while it lasts: for single-threaded test code only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def _wider(dtype):
    return torch.float64 if dtype is torch.float32 else dtype


@contextlib.contextmanager
def float32_casts_stay_float64():
    to, flt, typ, softmax, t_softmax = torch.Tensor.to, torch.Tensor.float, torch.Tensor.type, F.softmax, torch.softmax

    def to64(self, *args, **kw):
        if self.dtype == torch.float64:
            args = tuple(_wider(a) for a in args)
            if "dtype" in kw:
                kw["dtype"] = _wider(kw["dtype"])
        return to(self, *args, **kw)

    def float64(self, *args, **kw):
        return self if self.dtype == torch.float64 else flt(self, *args, **kw)

    def type64(self, *args, **kw):
        if self.dtype == torch.float64 and args and args[0] is torch.float32:
            return self
        return typ(self, *args, **kw)

    def softmax64(x, *args, dtype=None, **kw):
        return softmax(x, *args, dtype=_wider(dtype) if x.dtype == torch.float64 else dtype, **kw)

    def t_softmax64(x, *args, dtype=None, **kw):
        return t_softmax(x, *args, dtype=_wider(dtype) if x.dtype == torch.float64 else dtype, **kw)

    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to64, float64, type64
    F.softmax, torch.softmax = softmax64, t_softmax64
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to, flt, typ
        F.softmax, torch.softmax = softmax, t_softmax


def to_float64(model):
    """`model` in float64, in place (experts computed one by one: grouped matmuls take no float64)."""
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")
    return model.double()
