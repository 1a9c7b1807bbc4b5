"""Memory release and resume: SGLang's /release_memory_occupation and /resume_memory_occupation.

A colocated trainer needs the engine's memory while it trains. Releasing a tag frees it until the tag
is resumed; generation is held meanwhile (running requests are retracted to the queue and continue
after the resume, new requests queue):
  * "kv_cache": the running batch's KV (by the retract) and the prefix cache;
  * "weights": the parameters go to a file (config.offload_dir), because a CPU engine has no other
    memory to park them in, and the weight receiver drops its spare receive buffers.
Freed heap pages are handed back to the OS so the process's RSS really drops.

Non-goals: device memory pools (CUDA, pinned host memory), releasing part of a tag, updating weights
while they are released (refused: resume first).
"""

from __future__ import annotations

import ctypes
import gc
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file

from miles.engine_api.errors import InvalidRequest
from miles.engine_api.types import MEMORY_TAGS
from miles.precision.linear import drop_stored
from miles.rollout.engine.model_runner import ModelRunner
from miles.rollout.engine.scheduler import Scheduler


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
            if "kv_cache" in tags:
                runner.prefix_cache.clear()
            if "weights" in tags and self._offload_path is None:
                self._offload_path = _offload(runner.model, self._offload_dir)
        if "weights" in tags:
            # Outside model_lock: a commit takes the receiver's lock, then model_lock.
            self._receiver.drop_spares()
        _return_freed_memory()

    def resume(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        tags = _check_tags(tags)
        with self._runner.model_lock:
            if "weights" in tags and self._offload_path is not None:
                _restore(self._runner.model, self._offload_path)
                os.unlink(self._offload_path)
                self._offload_path = None
        self._scheduler.unhold(tags)

    def close(self) -> None:
        """Delete the offload file, if weights are released (the engine is stopping)."""
        if self._offload_path is not None:
            os.unlink(self._offload_path)
            self._offload_path = None


def _offload(model, offload_dir: str | None) -> str:
    """Save the parameters to a new file and empty them; returns the file's path."""
    fd, path = tempfile.mkstemp(prefix="miles-engine-weights-", suffix=".safetensors", dir=offload_dir)
    os.close(fd)
    params = dict(model.named_parameters())  # tied weights appear once
    save_file({n: p.data.contiguous() for n, p in params.items()}, path)
    for p in params.values():
        p.data = torch.empty(0, dtype=p.dtype)
    drop_stored(model)  # quantized copies are made again from the restored weights
    return path


def _restore(model, path: str) -> None:
    loaded = load_file(path)
    for n, p in model.named_parameters():
        p.data = loaded[n]


def _check_tags(tags) -> tuple[str, ...]:
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad or not tags:
        raise InvalidRequest(f"tags: {bad or tags!r} - send a non-empty subset of {list(MEMORY_TAGS)}")
    return tuple(tags)


def _return_freed_memory() -> None:
    """Hand freed heap pages back to the OS so the RSS really drops (glibc keeps them otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
