"""Weight-sync time per transport on a GPU fleet: how long one full update of every engine takes.

    broadcast   every engine device receives the whole update from the trainer's sources:
                wire_bytes / (nic x efficiency(engine nodes))
    p2p         each trainer device writes the shards its engine ranks need, straight into their memory:
                wire_bytes / (P2P_RATE_IN_NICS x nic), never faster than the busiest NIC allows
    disk_delta  the changed bytes are written once and read by every engine node, which patches its
                local copy and reloads it from NVMe
    disk        a full checkpoint written by the trainer's nodes and reloaded by every engine node
    colocated   a device-local handoff (trainer and engine on the same device)
Each adds the engines' requantization when they hold FP8 weights and the trainer trains in BF16.

Which constants are fitted and which are spec sheets. The network, memory and disk figures come
from the fleet (fleet.py, spec sheets). Four constants are FITTED to the one public table of
large-scale weight-sync times, radixark/miles docs/advanced/p2p-weight-transfer.md ("Profiling
Results": H100-80GB clusters, 400 Gb/s per GPU, 8 GPUs per node, 1 GB buckets, steady-state steps
3-12), so a projection reproduces those rows by construction and says nothing independent about them:

| row (engines x devices, nodes) | NCCL s | RDMA s |
|---|---|---|
| Qwen3-235B-A22B, 2 x 32, 8 nodes | 10.75 | 3.16 |
| GLM-5 744B, 2 x 64, 16 nodes | 58.30 | 8.48 |
| Kimi-K2 1T (FP8 engines), 8 x 32, 32 nodes | 53.28 | 7.23 (incl. 0.884 s requantization) |

The broadcast's share of NIC bandwidth falls with the number of receiving nodes (0.87 at 8, 0.51 at
16, 0.40 at 32): a power law in nodes fits the three within 10%. No first-principles derivation is
claimed: a pipelined ring broadcast is in theory flat in the number of receivers; the table is not.
The P2P times grow with the bytes of one engine copy at a near-constant rate (149, 175, 164 GB/s),
not with the per-device volumes (0.3-0.6 s at NIC speed on those fleets), which suggests the
preparation (gather, conversion, staging into registered buffers) rather than the wire bounds it;
the model scales that rate with the NIC, an assumption no published figure tests.
Small fleets are outside the fit: the same page measures P2P slower than NCCL on one or two nodes
(fixed per-update costs this model leaves out).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.capacity.fleet import GB, DeviceSpec, Layout
from miles.capacity.shapes import ModelShape

BROADCAST_NIC_FRACTION_AT_16_NODES = 0.562
"""FITTED. Share of one NIC's bandwidth a broadcast delivers to every engine device at 16 receiving nodes."""
BROADCAST_NODE_EXPONENT = 0.568
"""FITTED. The share falls as (16 / nodes) ** this; capped at the whole NIC for small fleets."""
P2P_RATE_IN_NICS = 3.25
"""FITTED. P2P moves one engine copy's bytes at this many NICs' bandwidth (162 GB/s on 50 GB/s NICs)."""
FITTED_NODES = (8, 32)
"""Engine nodes the fitted rows span; a projection outside says so."""
REQUANT_GBPS_PER_DEVICE = 36.9
"""FITTED (one figure). An engine device requantizes its share of an FP8 update at this rate: Kimi-K2's
0.884 s post_load_weights for 1.04 TB over 32 devices per engine."""
DELTA_DENSITY = 0.02
"""ASSUMED. Fraction of bytes that change between consecutive RL steps: the seed's illustrative 2%
(the Miles report gives no figure); `miles bench sync` measures it for a real small model."""
NVME_EFFICIENCY = 0.8
"""ASSUMED. Share of a drive's sequential spec rate a large file read or write reaches."""
HBM_COPY_EFFICIENCY = 0.5
"""ASSUMED. A device-local copy reads and writes every byte: half the memory bandwidth."""

TRANSPORTS = ("broadcast", "p2p", "disk_delta", "disk", "colocated")


@dataclass(frozen=True)
class SyncEstimate:
    """One transport's projected time for one full update, and what it moves."""

    transport: str
    seconds: float
    """Wall time of one update of every engine."""
    wire_bytes: float
    """Bytes the transport moves for one update: every engine's copy over the network, or the files written."""
    basis: str
    """What bounds it, in words."""


def broadcast_nic_fraction(engine_nodes: int) -> float:
    return min(1.0, BROADCAST_NIC_FRACTION_AT_16_NODES * (16 / max(1, engine_nodes)) ** BROADCAST_NODE_EXPONENT)


def requant_s(shape: ModelShape, layout: Layout) -> float:
    """Engines holding FP8 weights requantize what a BF16 trainer sends (zero for BF16 engines)."""
    if shape.engine_dtype != "fp8":
        return 0.0
    return shape.wire_bytes / layout.devices_per_engine / (REQUANT_GBPS_PER_DEVICE * GB)


def estimate(transport: str, shape: ModelShape, device: DeviceSpec, layout: Layout,
             delta_density: float = DELTA_DENSITY) -> SyncEstimate:
    wire = shape.wire_bytes
    nic = device.nic_gbps * GB
    post = requant_s(shape, layout)
    nodes = layout.engine_nodes(device)
    # An engine spanning several nodes holds a share of the copy on each; several engines on one node
    # hold several copies there.
    node_bytes = wire * device.devices_per_node / layout.devices_per_engine
    if transport == "broadcast":
        frac = broadcast_nic_fraction(nodes)
        outside = "" if FITTED_NODES[0] <= nodes <= FITTED_NODES[1] else \
            f"; outside the fitted {FITTED_NODES[0]}-{FITTED_NODES[1]} nodes"
        return SyncEstimate(transport, wire / (nic * frac) + post, wire * layout.engines,
                            f"each engine device receives {wire / GB:.0f} GB at {frac:.2f} of its NIC "
                            f"({nodes} engine nodes{outside})")
    if transport == "p2p":
        rate = wire / (P2P_RATE_IN_NICS * nic)
        per_sender = wire * layout.engines / layout.trainer_devices / nic
        per_receiver = wire / layout.devices_per_engine / nic
        floor = max(per_sender, per_receiver)
        bound = "preparation rate (fitted)" if rate >= floor else "busiest NIC"
        return SyncEstimate(transport, max(rate, floor) + post, wire * layout.engines,
                            f"{bound}; NIC floor {floor:.2f} s")
    if transport == "disk_delta":
        delta = wire * delta_density
        write = delta / (device.nvme_write_gbps * GB * NVME_EFFICIENCY)
        # Every engine node reads the delta from the node that wrote it, whose NICs serve them all.
        fetch = delta * nodes / (nic * device.devices_per_node)
        patch = node_bytes * delta_density / (device.nvme_write_gbps * GB * NVME_EFFICIENCY)
        reload = node_bytes / (device.nvme_read_gbps * GB * NVME_EFFICIENCY)
        return SyncEstimate(transport, write + fetch + patch + reload + post, delta,
                            f"{delta_density:.1%} of {wire / GB:.0f} GB changed; reload {reload:.1f} s from NVMe")
    if transport == "disk":
        writers = layout.trainer_nodes(device)
        write = wire / (writers * device.nvme_write_gbps * GB * NVME_EFFICIENCY)
        reload = node_bytes / (device.nvme_read_gbps * GB * NVME_EFFICIENCY)
        return SyncEstimate(transport, write + reload + post, wire,
                            f"full checkpoint written by {writers} nodes, reloaded from NVMe")
    if transport == "colocated":
        per_device = wire / layout.devices_per_engine
        return SyncEstimate(transport, per_device / (device.memory_bw_gbps * GB * HBM_COPY_EFFICIENCY) + post, 0.0,
                            "device-local copy of each device's share")
    raise ValueError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")


def estimates(shape: ModelShape, device: DeviceSpec, layout: Layout,
              delta_density: float = DELTA_DENSITY) -> dict[str, SyncEstimate]:
    """Every transport that fits the layout (colocated only when the placement is colocated)."""
    names = [t for t in TRANSPORTS if t != "colocated" or layout.colocated]
    return {t: estimate(t, shape, device, layout, delta_density) for t in names}
