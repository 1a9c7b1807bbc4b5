"""The trainer's optimizer, with its state optionally kept off the accelerator between steps.

With offload on, parameters are split into buckets (about `offload_bucket_mb` of optimizer state
each) with one AdamW per bucket. The step streams bucket by bucket: bring one bucket's state back,
step it, send it away again, so at most one bucket of optimizer state is resident at a time.
  cpu:  state waits in (pinned) CPU memory. On a CPU-only machine the device *is* CPU memory, so
        this mode changes nothing there; it exists for accelerators.
  disk: state waits in one file per bucket; resident state drops to one bucket on any machine.
Non-goal: offloading parameters or gradients (FSDP2's own CPU offload covers parameters).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def _bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class OptimizerSet:
    def __init__(self, params, cfg, lr_fn, rank: int = 0):
        import torch

        self.mode = cfg.offload_optimizer
        if self.mode == "none":
            buckets = [params]
        else:
            # AdamW keeps two fp32 moments per parameter element: ~2× the parameter's bytes.
            limit = cfg.offload_bucket_mb * 2 ** 20
            buckets, cur, size = [], [], 0
            for p in params:
                if cur and size + 2 * _bytes(p) > limit:
                    buckets.append(cur)
                    cur, size = [], 0
                cur.append(p)
                size += 2 * _bytes(p)
            if cur:
                buckets.append(cur)
        self.optimizers = [torch.optim.AdamW(b, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                             betas=(cfg.adam_beta1, cfg.adam_beta2)) for b in buckets]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_fn) for o in self.optimizers]
        self._away: list[dict | None] = [None] * len(self.optimizers)
        if self.mode == "disk":
            base = cfg.offload_dir or tempfile.mkdtemp(prefix="miles-optim-")
            self.dir = Path(base) / f"rank{rank}"
            self.dir.mkdir(parents=True, exist_ok=True)
        self.resident_bytes = 0
        self.peak_resident_bytes = 0

    @property
    def last_lr(self) -> float:
        return float(self.schedulers[0].get_last_lr()[0])

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def step(self) -> None:
        for i, opt in enumerate(self.optimizers):
            self._bring_back(i)
            opt.step()
            self._send_away(i)
        for s in self.schedulers:
            s.step()

    def state_bytes(self) -> int:
        """Optimizer-state bytes that currently live in the optimizers (resident)."""
        return sum(_bytes(v) for o in self.optimizers for st in o.state.values() for v in st.values()
                   if hasattr(v, "element_size"))

    @contextlib.contextmanager
    def materialized(self):
        """All optimizer state resident (for checkpoints), then sent away again."""
        for i in range(len(self.optimizers)):
            self._bring_back(i)
        try:
            yield self.optimizers
        finally:
            for i in range(len(self.optimizers)):
                self._send_away(i)

    # -- moving state -----------------------------------------------------------------------------
    def _track(self) -> None:
        self.resident_bytes = self.state_bytes()
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def _send_away(self, i: int) -> None:
        self._track()
        if self.mode == "none":
            return
        opt = self.optimizers[i]
        params = opt.param_groups[0]["params"]
        saved = []
        for p in params:
            st = opt.state.get(p, {})
            saved.append({k: _to_host(v) for k, v in st.items()})
        if self.mode == "disk":
            import torch

            path = self.dir / f"bucket{i}.pt"
            torch.save([{k: v[0] for k, v in s.items()} for s in saved], path)
            self._away[i] = {"path": path, "meta": [{k: v[1] for k, v in s.items()} for s in saved]}
        else:
            self._away[i] = {"state": saved}
        for p in params:
            opt.state.pop(p, None)

    def _bring_back(self, i: int) -> None:
        away = self._away[i]
        if away is None:
            self._track()
            return
        import torch

        opt = self.optimizers[i]
        params = opt.param_groups[0]["params"]
        if "path" in away:
            locals_ = torch.load(away["path"], weights_only=True)
            states = [{k: (loc[k], away["meta"][j][k]) for k in loc} for j, loc in enumerate(locals_)]
            os.unlink(away["path"])
        else:
            states = away["state"]
        for p, st in zip(params, states):
            if st:
                opt.state[p] = {k: _to_device(v, p) for k, v in st.items()}
        self._away[i] = None
        self._track()


def _to_host(v):
    """(host tensor, DTensor layout or None): DTensor shards travel as their local piece."""
    if hasattr(v, "to_local"):
        return v.to_local().to("cpu", copy=True), (v.device_mesh, v.placements, v.shape, v.stride())
    if hasattr(v, "to"):
        return v.to("cpu", copy=True), None
    return v, None


def _to_device(v, param):
    local, layout = v
    device = param.to_local().device if hasattr(param, "to_local") else param.device
    if hasattr(local, "to"):
        local = local.to(device)
    if layout is None:
        return local
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = layout
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
