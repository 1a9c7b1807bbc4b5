"""Fixtures of the trainer's tests."""

from __future__ import annotations

import pytest

from miles.net import free_port


@pytest.fixture(scope="module")
def gloo():
    """A one-rank gloo process group for a test module's in-process trainers."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
