"""Fleets: the devices a run is placed on and the figures of their spec sheets that a projection
uses (memory, memory bandwidth, dense BF16 arithmetic, scale-up and scale-out bandwidth, local NVMe).

Non-goal: a network simulator. Every figure is a peak from a public spec sheet; what a run achieves
of it is an efficiency constant in projection.py or weight_sync.py, named and documented there.

Sources:
  * H100 SXM5 80GB: 3.35 TB/s HBM3, 989 TFLOPS dense BF16, NVLink 900 GB/s (NVIDIA H100 datasheet);
    DGX H100: 8 GPUs, 8x ConnectX-7 400 Gb/s (one per GPU), 8x 3.84 TB NVMe U.2 (DGX H100 user guide).
  * H200 SXM 141GB: 4.8 TB/s HBM3e, otherwise H100's compute and NVLink (NVIDIA H200 datasheet).
  * B200: 180 GB HBM3e and 8 TB/s per GPU, 2.25 PFLOPS dense BF16, NVLink 1.8 TB/s; DGX B200: 8 GPUs,
    8x ConnectX-7 400 Gb/s (DGX B200 datasheet).
  * GB300 NVL72: 288 GB HBM3e and 8 TB/s per GPU, 2.5 PFLOPS dense BF16 per GPU (180 PF per 72),
    NVLink 1.8 TB/s, ConnectX-8 800 Gb/s per GPU, 4 GPUs per compute tray (GB300 NVL72 datasheet).
  * NVMe: a PCIe Gen4 data-centre drive reads ~6.5 GB/s and writes ~3.5 GB/s sequentially (e.g. Samsung
    PM1733 datasheet); Gen5 drives ~13 GB/s and ~7 GB/s (e.g. Micron 9550).
  * cpu: this machine's own figures, measured by `miles bench sync` (capacity/calibration.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from miles.config.loader import ConfigError

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One kind of device and the node it sits in."""

    name: str
    """Preset name."""
    memory_gb: float
    """Device memory (HBM), GB."""
    memory_bw_gbps: float
    """Peak memory bandwidth, GB/s (decode reads every weight once per step)."""
    bf16_tflops: float
    """Peak dense BF16 arithmetic, TFLOPS."""
    scale_up_gbps: float
    """Device-to-device bandwidth inside a node (NVLink), GB/s per direction."""
    nic_gbps: float
    """Scale-out network bandwidth per device (one NIC per GPU), GB/s."""
    devices_per_node: int
    """Devices in one node (one host, one set of local disks)."""
    nvme_read_gbps: float
    """Sequential read of the node's local NVMe drives together, GB/s."""
    nvme_write_gbps: float
    """Sequential write of the node's local NVMe drives together, GB/s."""
    memcpy_gbps: float = 0.0
    """Host memory copy rate, GB/s (set for cpu fleets by calibration; GPU fleets stage through HBM)."""


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", memory_gb=80, memory_bw_gbps=3350, bf16_tflops=989, scale_up_gbps=450,
                       nic_gbps=400 / 8, devices_per_node=8, nvme_read_gbps=8 * 6.5, nvme_write_gbps=8 * 3.5),
    "h200": DeviceSpec("h200", memory_gb=141, memory_bw_gbps=4800, bf16_tflops=989, scale_up_gbps=450,
                       nic_gbps=400 / 8, devices_per_node=8, nvme_read_gbps=8 * 6.5, nvme_write_gbps=8 * 3.5),
    "b200": DeviceSpec("b200", memory_gb=180, memory_bw_gbps=8000, bf16_tflops=2250, scale_up_gbps=900,
                       nic_gbps=400 / 8, devices_per_node=8, nvme_read_gbps=8 * 6.5, nvme_write_gbps=8 * 3.5),
    "gb300": DeviceSpec("gb300", memory_gb=288, memory_bw_gbps=8000, bf16_tflops=2500, scale_up_gbps=900,
                        nic_gbps=800 / 8, devices_per_node=4, nvme_read_gbps=4 * 13.0, nvme_write_gbps=4 * 7.0),
}
"""Spec-sheet presets (sources in the module docstring). NVLink figures are per direction."""


@dataclass(frozen=True)
class Fleet:
    """The devices of one run."""

    device: DeviceSpec
    """What every device is."""
    devices: int
    """Devices in the run, trainer and engines together."""

    @property
    def nodes(self) -> int:
        return -(-self.devices // self.device.devices_per_node)


def device_spec(name: str, **overrides: float) -> DeviceSpec:
    """A preset, with any of its figures replaced (`--nic-gbps 25` for a slower network)."""
    if name not in DEVICES:
        raise ConfigError(f"--device {name!r} is not a known device; choose one of {', '.join(DEVICES)} "
                          "(cpu fleets come from a calibration: --calibrate)")
    set_ = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(DEVICES[name], **set_) if set_ else DEVICES[name]


@dataclass(frozen=True)
class Layout:
    """How a fleet's devices are split between the trainer and the engines."""

    trainer_devices: int
    """Devices the trainer's ranks run on."""
    engines: int
    """Engine replicas; each holds a whole copy of the weights."""
    devices_per_engine: int
    """Devices one engine spans (its tensor/expert-parallel size)."""
    colocated: bool = False
    """Trainer and engines take turns on the same devices."""

    @property
    def engine_devices(self) -> int:
        return self.engines * self.devices_per_engine

    def engine_nodes(self, device: DeviceSpec) -> int:
        return -(-self.engine_devices // device.devices_per_node)

    def trainer_nodes(self, device: DeviceSpec) -> int:
        return -(-self.trainer_devices // device.devices_per_node)
