"""Mixed precision on one rank without FSDP: bfloat16 compute copies of float32 master weights.

Between steps the parameters hold the float32 master weights, which the optimizer steps and every
reader (weight sync, checkpoints, the reference refresh) sees. For the forward and backward they hold
bfloat16 copies, cast once per step; each micro-batch's bfloat16 gradients are added into float32
accumulators, which become the parameters' gradients again before the optimizer step. These are the
numerics of FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on one rank
(tests/unit/trainer/backends/test_compute_copy.py checks it), without its per-layer all-gather
copies, hooks and DTensor dispatch, which on one rank are pure cost: with them miles' step ran at
0.60x a plain bf16-autocast loop on the H200 and on CPU alike.

Non-goal: more than one rank (FSDP2 shards those), tensor/expert-parallel layouts.
"""

from __future__ import annotations

import torch


class ComputeCopy:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.params = list(model.parameters())  # each Parameter once (tied weights are one)
        self.dtype = dtype
        self._master: list[torch.Tensor] | None = None  # set while the parameters hold compute copies
        self._grads: list[torch.Tensor | None] = [None] * len(self.params)  # float32 accumulators

    @torch.no_grad()
    def to_compute(self) -> None:
        """Parameters hold bfloat16 copies (before a forward); a no-op when they already do."""
        if self._master is not None:
            return
        self._master = [p.data for p in self.params]
        for i, p in enumerate(self.params):
            if p.grad is not None:  # a gradient already accumulated (the master's dtype): keep adding to it
                self._grads[i] = p.grad
                p.grad = None
            p.data = p.data.to(self.dtype)

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add the gradients of the backward just run into the float32 accumulators (after each backward)."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = p.grad.float()
            self._grads[i] = g if self._grads[i] is None else self._grads[i].add_(g)
            p.grad = None

    @torch.no_grad()
    def to_master(self) -> None:
        """Parameters hold the float32 master weights again, with the accumulated gradients (before the
        optimizer step, and before anything reads the weights); a no-op when they already do."""
        if self._master is None:
            return
        self.accumulate()
        for i, (p, m) in enumerate(zip(self.params, self._master)):
            p.data = m
            p.grad = self._grads[i]
            self._grads[i] = None
        self._master = None
