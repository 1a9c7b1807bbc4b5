"""The capacity model against the figures the seeds and Miles' docs publish (within 20%).

Four of its constants were fitted to the P2P table below (miles/capacity/weight_sync.py says which),
so the table rows check that the fit and the code agree; the checkpoint size is arithmetic from the
model card, and the "about a minute" of the seed is the same Kimi-K2 row rounded."""

from __future__ import annotations

import pytest

from miles.capacity import weight_sync
from miles.capacity.fleet import DEVICES, Layout
from miles.capacity.projection import Workload, project
from miles.capacity.shapes import PRESETS, model_shape

# radixark/miles docs/advanced/p2p-weight-transfer.md, "Profiling Results" (H100-80GB, 8 per node):
# model, trainer devices, engines x devices per engine, NCCL s, RDMA s
P2P_TABLE = [
    ("qwen3-235b-a22b", 64, 2, 32, 10.7536, 3.1620),
    ("glm-5-744b", 128, 2, 64, 58.3015, 8.4797),
    ("kimi-k2-1t", 256, 8, 32, 53.2791, 7.2273),
]


def _within(projected: float, published: float, tol: float = 0.2) -> bool:
    return abs(projected / published - 1) <= tol


@pytest.mark.parametrize("name,trainer,engines,per_engine,nccl_s,rdma_s", P2P_TABLE)
def test_p2p_table_rows_within_20_percent(name, trainer, engines, per_engine, nccl_s, rdma_s):
    layout = Layout(trainer_devices=trainer, engines=engines, devices_per_engine=per_engine)
    shape, h100 = PRESETS[name], DEVICES["h100"]
    bc = weight_sync.estimate("broadcast", shape, h100, layout).seconds
    p2p = weight_sync.estimate("p2p", shape, h100, layout).seconds
    assert _within(bc, nccl_s), (name, bc, nccl_s)
    assert _within(p2p, rdma_s), (name, p2p, rdma_s)
    assert p2p < bc  # at these sizes p2p is the fast path, as published


def test_bf16_checkpoint_of_a_744b_model_is_about_1_5_tb():
    shape = model_shape("744B")
    assert shape.name == "glm-5-744b"
    assert _within(shape.checkpoint_bytes_bf16 / 1e12, 1.5)


def test_full_nccl_broadcast_of_a_1t_model_takes_about_a_minute():
    layout = Layout(trainer_devices=256, engines=8, devices_per_engine=32)
    seconds = weight_sync.estimate("broadcast", model_shape("1T"), DEVICES["h100"], layout).seconds
    assert _within(seconds, 60.0)


def test_broadcast_slows_with_receiving_nodes_and_p2p_does_not():
    """What the model says beyond the table: at a fixed model the broadcast's time grows with the
    engine fleet (each device receives the whole copy at a falling share of its NIC), p2p's does not."""
    shape, h100 = PRESETS["glm-5-744b"], DEVICES["h100"]
    small = Layout(trainer_devices=64, engines=1, devices_per_engine=64)
    large = Layout(trainer_devices=64, engines=4, devices_per_engine=64)
    assert weight_sync.estimate("broadcast", shape, h100, large).seconds > \
        1.4 * weight_sync.estimate("broadcast", shape, h100, small).seconds
    assert weight_sync.estimate("p2p", shape, h100, large).seconds == \
        pytest.approx(weight_sync.estimate("p2p", shape, h100, small).seconds)


def test_fp8_engines_pay_the_requantization_and_move_half_the_bytes():
    kimi = PRESETS["kimi-k2-1t"]
    assert kimi.wire_bytes == pytest.approx(kimi.params, rel=0.01)  # ~1 byte per parameter
    layout = Layout(trainer_devices=256, engines=8, devices_per_engine=32)
    assert weight_sync.requant_s(kimi, layout) == pytest.approx(0.884, rel=0.02)
    assert weight_sync.requant_s(PRESETS["glm-5-744b"], layout) == 0.0


def test_optimizer_offload_is_what_lets_744b_train_on_32_gb300s():
    """The seed's claim: offloading optimizer state lets a 744B trainer fit on 32 GB300s."""
    shape, gb300 = PRESETS["glm-5-744b"], DEVICES["gb300"]
    layout = Layout(trainer_devices=32, engines=2, devices_per_engine=16)
    on_device = project(shape, gb300, layout, Workload())
    offloaded = project(shape, gb300, layout, Workload(offload_optimizer=True))
    assert not on_device.fits and on_device.trainer_memory_gb > gb300.memory_gb
    assert offloaded.fits and offloaded.trainer_memory_gb < gb300.memory_gb
