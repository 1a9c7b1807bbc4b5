"""Memory release and resume: SGLang's /release_memory_occupation and /resume_memory_occupation.

A colocated trainer needs the engine's memory while it trains. Releasing a tag frees it until the tag
is resumed; generation is held meanwhile (running requests are retracted to the queue and continue
after the resume, new requests queue):
  * "kv_cache": the running batch's KV (by the retract; the fast decode's static buffers are freed)
    and the prefix cache;
  * "weights": the parameters leave the device: a CUDA engine parks them in host memory, a CPU engine
    (which has no other memory) in a file (config.offload_dir); the weight receiver drops its spare
    receive buffers.
Freed memory is handed back: heap pages to the OS so the RSS really drops, and on cuda the allocator's
cached blocks to the driver, so a trainer process sharing the card can take them.

Non-goals: releasing part of a tag, updating weights while they are released (refused: resume first).
"""

from __future__ import annotations

import ctypes
import gc
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file

from miles.devices import release_cached
from miles.engine_api.errors import InvalidRequest
from miles.engine_api.types import MEMORY_TAGS
from miles.precision.linear import drop_stored
from miles.engine.model_runner import ModelRunner
from miles.engine.scheduler import Scheduler


class Memory:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, receiver, offload_dir: str | None):
        self._runner = runner
        self._scheduler = scheduler
        self._receiver = receiver  # WeightReceiver
        self._offload_dir = offload_dir
        self._offload_path: str | None = None  # where the released weights are; None while they are loaded

    @property
    def weights_released(self) -> bool:
        return self._offload_path is not None

    def release(self, tags: tuple[str, ...] = MEMORY_TAGS, timeout: float = 120.0) -> None:
        """Free `tags` until `resume`; returns once no forward is running and the memory is freed."""
        tags = _check_tags(tags)
        self._scheduler.hold(tags)
        self._scheduler.quiesce("retract", timeout)
        runner = self._runner
        with runner.model_lock:
            # CUDA graphs hold a pool of memory and read the weights and KV where they were captured.
            runner.release_static(kv="kv_cache" in tags)
            if "kv_cache" in tags:
                runner.prefix_cache.clear()
            if "weights" in tags and self._offload_path is None:
                self._offload_path = _offload(runner.model, self._offload_dir)
        if "weights" in tags:
            # Outside model_lock: a commit takes the receiver's lock, then model_lock.
            self._receiver.drop_spares()
        _return_freed_memory(runner.device)

    def resume(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        tags = _check_tags(tags)
        with self._runner.model_lock:
            if "weights" in tags and self._offload_path is not None:
                _restore(self._runner.model, self._offload_path)
                if self._offload_path != HOST_MEMORY:
                    os.unlink(self._offload_path)
                self._offload_path = None
        self._scheduler.unhold(tags)

    def close(self) -> None:
        """Delete the offload file, if weights are released (the engine is stopping)."""
        if self._offload_path not in (None, HOST_MEMORY):
            os.unlink(self._offload_path)
        self._offload_path = None


HOST_MEMORY = "host-memory"
"""Where a CUDA engine's released weights are (the parameters' `_host` copies), in place of a file path."""


def _offload(model, offload_dir: str | None) -> str:
    """Move the parameters off the device and empty them; returns where they went: HOST_MEMORY for a
    CUDA engine (pinned host copies, kept on each parameter), else the path of a new file."""
    params = dict(model.named_parameters())  # tied weights appear once
    if next(iter(params.values())).device.type == "cuda":
        for p in params.values():
            host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
            host.copy_(p.data, non_blocking=True)
            p._host, p.data = host, torch.empty(0, dtype=p.dtype, device=p.device)
        torch.cuda.synchronize()
        drop_stored(model)
        return HOST_MEMORY
    fd, path = tempfile.mkstemp(prefix="miles-engine-weights-", suffix=".safetensors", dir=offload_dir)
    os.close(fd)
    save_file({n: p.data.contiguous() for n, p in params.items()}, path)
    for p in params.values():
        p.data = torch.empty(0, dtype=p.dtype)
    drop_stored(model)  # quantized copies are made again from the restored weights
    return path


def _restore(model, path: str) -> None:
    if path == HOST_MEMORY:
        for p in model.parameters():
            p.data = p._host.to(p.device, non_blocking=True)
            del p._host
        torch.cuda.synchronize()
        return
    loaded = load_file(path)
    for n, p in model.named_parameters():
        p.data = loaded[n]


def _check_tags(tags) -> tuple[str, ...]:
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad or not tags:
        raise InvalidRequest(f"tags: {bad or tags!r} - send a non-empty subset of {list(MEMORY_TAGS)}")
    return tuple(tags)


def _return_freed_memory(device) -> None:
    """Hand freed memory back: the allocator's cached device blocks to the driver, and heap pages to the
    OS so the RSS really drops (glibc keeps them otherwise)."""
    gc.collect()
    release_cached(device)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
