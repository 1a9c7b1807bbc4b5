"""Where the trainer computes: its device, the dtype its forward and backward run in, and the
collective backend of its process group, all from `trainer.device`, `trainer.param_dtype` and
`trainer.collective_backend` (defaults: cpu, float32, gloo). The one place these are decided.

Master weights and optimizer state are float32 whatever the compute dtype: with bfloat16, FSDP2
casts each layer's float32 shards to bfloat16 for the forward and backward and reduces gradients in
float32 (MixedPrecisionPolicy). Weights leave the trainer through host memory (HOST), which every
transport reads; on a CPU trainer that costs nothing.

Non-goals: device placement of engines (engine/); docs/scaling.md says what has run where.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from miles.devices import exact_float32, resolve

HOST = torch.device("cpu")
"""Host memory: where full weights are handed to the transports and exports are assembled."""

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def collective_backend(device: str, backend: str = "auto") -> str:
    """torch.distributed backend for a device: auto = gloo on cpu, nccl on cuda."""
    if backend != "auto":
        return backend
    return _BACKENDS[resolve(device, "trainer.device") if device == "auto" else device]


def compute_device(device: str, rank: int) -> torch.device:
    """This rank's device (`auto` resolved here). On cuda, rank r takes visible GPU r mod count (one GPU
    per rank when Ray or CUDA_VISIBLE_DEVICES shows each rank its own; ranks that share one card see
    it as GPU 0)."""
    if resolve(device, "trainer.device") == "cpu":
        return HOST
    exact_float32()  # float32 computes as on cpu (param_dtype bfloat16 is the faster path)
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def join_trainer_group(cfg, rank: int, world_size: int, master_addr: str, master_port: int) -> torch.device:
    """This rank's device (compute_device), once it is in the trainer's process group at
    master_addr:master_port (joined once per process; `cfg` is the TrainerConfig)."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    device = compute_device(cfg.device, rank)
    if not dist.is_initialized():
        dist.init_process_group(collective_backend(cfg.device, cfg.collective_backend), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))
    return device


def param_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def mixed_precision(name: str):
    """FSDP2's policy for a compute dtype (None for float32: parameters compute as stored)."""
    if name == "float32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype(name), reduce_dtype=torch.float32)
