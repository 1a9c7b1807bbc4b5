"""CUDA IPC handles as JSON (miles/sync/cuda_ipc.py): what an engine refuses runs everywhere; a real
handle from another process is opened where torch sees a GPU (`cuda`, scripts/gpu-check.sh)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from miles.sync.cuda_ipc import open_handle
from miles.sync.transports.base import WeightUpdateError

_SENDER = """
import json, sys, torch
from miles.sync.cuda_ipc import share
buf = torch.arange(4096, dtype=torch.int32, device="cuda").view(torch.uint8)
torch.cuda.synchronize()
print(json.dumps(share(buf)), flush=True)
sys.stdin.read()  # keeps the buffer alive until the test has read it
"""


def test_a_handle_missing_fields_is_refused_naming_them():
    with pytest.raises(WeightUpdateError, match="ipc_handle: send an object with size, stride"):
        open_handle({"size": [4]}, torch.device("cpu"))


def test_a_cpu_engine_refuses_gpu_memory_and_names_the_format_to_use():
    fields = ("size", "stride", "offset", "dtype", "handle", "storage_size", "storage_offset", "ref_counter_handle",
              "ref_counter_offset", "event_handle", "event_sync_required", "gpu_uuid")
    with pytest.raises(WeightUpdateError, match="computes on the CPU, so it cannot map GPU memory; send load_format "
                                                "'shm'"):
        open_handle(dict.fromkeys(fields), torch.device("cpu"))


@pytest.mark.cuda
def test_a_buffer_shared_by_another_process_is_read_here_as_it_wrote_it():
    proc = subprocess.Popen([sys.executable, "-c", _SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        handle = json.loads(proc.stdout.readline())
        buf = open_handle(handle, torch.device("cuda", torch.cuda.current_device()))
        assert torch.equal(buf.view(torch.int32).cpu(), torch.arange(4096, dtype=torch.int32))
        with pytest.raises(WeightUpdateError, match="is not this engine's"):
            open_handle({**handle, "gpu_uuid": "GPU-elsewhere"}, torch.device("cuda", torch.cuda.current_device()))
    finally:
        proc.stdin.close()
        proc.wait(30)
