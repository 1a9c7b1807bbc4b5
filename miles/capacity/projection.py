"""A run's projected cost on a fleet: step time (rollout, train, sync, and how the schedule overlaps
them) and memory per device, from the model's shape, the fleet's spec sheets and the run config.

    rollout  decode is memory-bound: one decode step reads each engine device's weights once, so
             step_s = weights per device / (memory_bw x DECODE_BW_EFFICIENCY); a step's samples
             decode in batches of decode_batch per engine, and the longest sample alone needs
             max_new_tokens decode steps (the long tail a synchronous step waits for)
    train    6 x active params FLOPs per trained token (forward + backward) plus 2 x for the
             old-policy logprobs (and 2 x more for a KL reference), at TRAIN_MFU of peak BF16
    sync     weight_sync.py, for the configured transport
    step     sync: rollout + train + sync; one_step_off and fully_async: the slower of rollout and
             train + sync (the overlap a disaggregated placement buys)
    memory   trainer: BF16 weights, FP32 gradients, FP32 master weights and Adam's two FP32 moments
             (18 bytes per parameter, Megatron's distributed-optimizer accounting) sharded over the
             trainer's devices, optimizer state off the device with trainer.offload_optimizer;
             engines: their share of the weights, the rest of ENGINE_MEMORY_FRACTION for the KV cache

Non-goals: activations beyond a recomputed layer input per token, communication inside a training
step, prefill time, and a validated step time: nothing here has been compared with a measured GPU step
(the one published step time, 263 s for a GLM-5.2 744B agentic step on 64 GB300s, comes without its
token counts). Weight-sync times are the validated part (weight_sync.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from miles.capacity import weight_sync
from miles.capacity.fleet import GB, DeviceSpec, Layout
from miles.capacity.shapes import ModelShape

DECODE_BW_EFFICIENCY = 0.6
"""ASSUMED. Share of peak memory bandwidth a decode step's weight reads reach."""
TRAIN_MFU = 0.25
"""ASSUMED. Model FLOPs utilisation of a large MoE training step (dense-equivalent FLOPs on active params)."""
TRAINER_BYTES_PER_PARAM = 18.0
"""BF16 weights 2 + FP32 gradients 4 + FP32 master 4 + Adam moments 8 (Megatron-LM distributed optimizer)."""
OPTIMIZER_BYTES_PER_PARAM = 12.0
"""The part trainer.offload_optimizer moves off the device: FP32 master weights and both Adam moments."""
ENGINE_MEMORY_FRACTION = 0.88
"""SGLang's default mem_fraction_static order of magnitude: weights + KV cache share of device memory."""


@dataclass(frozen=True)
class Workload:
    """What one training step generates and trains on (from the run config)."""

    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    prompt_tokens: int = 1024
    """Mean prompt length (not in the run config: a simulate flag)."""
    max_new_tokens: int = 4096
    mean_response_fraction: float = 0.5
    """Mean response length as a fraction of max_new_tokens (the longest still runs to the cap)."""
    decode_batch: int = 256
    """Sequences one engine decodes together."""
    schedule: str = "sync"
    transport: str = "broadcast"
    reference_model: bool = False
    """A KL reference forward per step."""
    offload_optimizer: bool = False

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def response_tokens(self) -> float:
        return self.samples * self.max_new_tokens * self.mean_response_fraction


@dataclass(frozen=True)
class Projection:
    """Everything `miles simulate` reports."""

    model: str
    device: str
    devices: int
    layout: dict
    rollout_s: float
    train_s: float
    sync_s: float
    step_s: float
    checkpoint_bf16_tb: float
    update_tb: float
    trainer_memory_gb: float
    engine_weights_gb: float
    engine_kv_gb: float
    device_memory_gb: float
    fits: bool
    sync_by_transport: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def decode_step_s(shape: ModelShape, device: DeviceSpec, layout: Layout) -> float:
    per_device = shape.wire_bytes / layout.devices_per_engine
    return per_device / (device.memory_bw_gbps * GB * DECODE_BW_EFFICIENCY)


def rollout_s(shape: ModelShape, device: DeviceSpec, layout: Layout, w: Workload) -> float:
    step = decode_step_s(shape, device, layout)
    throughput = layout.engines * w.decode_batch / step  # tokens per second over the fleet
    return max(w.response_tokens / throughput, w.max_new_tokens * step)


def train_s(shape: ModelShape, device: DeviceSpec, layout: Layout, w: Workload) -> float:
    tokens = w.samples * w.prompt_tokens + w.response_tokens
    passes = 6 + 2 + (2 if w.reference_model else 0)
    flops = passes * shape.active_params * tokens
    return flops / (layout.trainer_devices * device.bf16_tflops * 1e12 * TRAIN_MFU)


def project(shape: ModelShape, device: DeviceSpec, layout: Layout, w: Workload,
            delta_density: float = weight_sync.DELTA_DENSITY) -> Projection:
    syncs = weight_sync.estimates(shape, device, layout, delta_density)
    if w.transport not in syncs:
        raise ValueError(f"sync.transport {w.transport!r} cannot be projected here; projected: {', '.join(syncs)}")
    r, t, s = rollout_s(shape, device, layout, w), train_s(shape, device, layout, w), syncs[w.transport].seconds
    step = r + t + s if (w.schedule == "sync" or layout.colocated) else max(r, t + s)
    per_param = TRAINER_BYTES_PER_PARAM - (OPTIMIZER_BYTES_PER_PARAM if w.offload_optimizer else 0.0)
    trainer_mem = shape.params * per_param / layout.trainer_devices / GB
    engine_w = shape.wire_bytes / layout.devices_per_engine / GB
    kv = device.memory_gb * ENGINE_MEMORY_FRACTION - engine_w
    if layout.colocated:
        # Turn-taking: the engines release their memory while the trainer works, and the other way round.
        fits = max(trainer_mem, engine_w) < device.memory_gb and kv > 0
    else:
        fits = trainer_mem < device.memory_gb and kv > 0
    return Projection(
        model=shape.name, device=device.name, devices=(layout.trainer_devices if layout.colocated
                                                       else layout.trainer_devices + layout.engine_devices),
        layout=asdict(layout), rollout_s=r, train_s=t, sync_s=s, step_s=step,
        checkpoint_bf16_tb=shape.checkpoint_bytes_bf16 / 1e12, update_tb=shape.wire_bytes / 1e12,
        trainer_memory_gb=trainer_mem, engine_weights_gb=engine_w, engine_kv_gb=kv,
        device_memory_gb=device.memory_gb, fits=fits,
        sync_by_transport={k: {"seconds": v.seconds, "wire_tb": v.wire_bytes / 1e12, "basis": v.basis}
                           for k, v in syncs.items()})
