"""Which device a component computes on: `auto`, `cpu` or `cuda`, as the trainer's and the built-in
engine's configs name it (`trainer.device`, `rollout.engine.device`).

`auto` is cuda when torch sees a GPU in the process that resolves it, else cpu: the embedded default
(a CPU-only machine) and a GPU machine run the same config unchanged. Every asked-for cuda without a
GPU is refused with the key that asked. Memory budgets are read here too: a GPU's total memory, or
the host's RAM for a CPU engine, so a memory fraction means the same thing on both. A process that
computes on cuda computes float32 as float32 (`exact_float32`): the same numerics as on cpu, whatever
the image sets; bfloat16 (trainer.param_dtype, rollout.engine.dtype) is the configured faster path.

Non-goals: choosing between several GPUs (Ray's CUDA_VISIBLE_DEVICES does that), other accelerators.
"""

from __future__ import annotations

import os

from miles.config.loader import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def cpu_threads(num_threads: int) -> int:
    """torch threads for a setting whose 0 means auto: every core this process may use."""
    if num_threads:
        return num_threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_name(name: str, key: str) -> None:
    if name not in DEVICES:
        raise ConfigError(f"{key} = {name!r}: choose auto (cuda when torch sees a GPU, else cpu), cpu or cuda")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve(name: str, key: str, gpu_present: bool | None = None) -> str:
    """`name` made concrete for this process: cpu or cuda. `gpu_present` overrides torch's view (a driver
    deciding for the cluster's GPUs rather than its own)."""
    check_name(name, key)
    present = cuda_available() if gpu_present is None else gpu_present
    if name == "auto":
        return "cuda" if present else "cpu"
    if name == "cuda" and not present:
        raise ConfigError(f"{key} = 'cuda' but torch sees no CUDA device here: set {key} = 'cpu' (or 'auto'), "
                          "or run where `python -c 'import torch; print(torch.cuda.is_available())'` prints True")
    return name


def total_memory(device) -> int:
    """Bytes of memory on `device`: the GPU's, or the host's physical RAM for cpu."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def release_cached(device) -> None:
    """Hand memory torch's allocator keeps cached back to the driver, so a process sharing the GPU gets it."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def gpu_uuid(device) -> str:
    """The physical GPU's UUID: device indices differ between processes that see different GPU sets."""
    import torch

    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


TF32_OVERRIDE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"
"""Set to 1 by NVIDIA's PyTorch containers: cuBLAS then multiplies float32 in TF32 (10-bit mantissa)
whatever torch's own flags say. torch reads it once, at the first matmul on the GPU."""


def exact_float32() -> None:
    """float32 matrix products on the GPU in full float32, as on cpu: torch's default precision, and an
    image's TF32 override dropped before the first product reads it. Call before any work on cuda."""
    import torch

    os.environ.pop(TF32_OVERRIDE, None)
    # The one switch: setting torch's legacy allow_tf32 flags beside it is refused by torch >= 2.9.
    torch.set_float32_matmul_precision("highest")
