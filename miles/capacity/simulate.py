"""`miles simulate`: project a run config onto a fleet and print a table and one JSON line.

    miles simulate run.toml --model-size 744B --gpus 64 --device gb300
    miles simulate run.toml --model-size glm-5-744b --gpus 256 --device h100 --engine-gpus 64
    miles simulate --device cpu --calibrate            (this host: the sync benchmark, projected)
    miles simulate --device cpu --calibrate-from bench.jsonl --model-size 134M

The run config supplies the workload (rollout.prompts_per_step, n_samples_per_prompt,
max_new_tokens, loop.schedule, sync.transport, placement.mode, trainer.offload_optimizer,
trainer.algorithm.kl_coef); `--rollout.x VALUE` overrides work as for `miles train`. The config is
read, not validated: its model path need not exist here. Non-goal: choosing a layout for you beyond
a simple default (half the devices train; engines get the fewest devices that hold the weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from miles.capacity import calibration, projection, weight_sync
from miles.capacity.fleet import DEVICES, GB, DeviceSpec, Layout, device_spec
from miles.capacity.shapes import PRESETS, ModelShape, model_shape, parse_size
from miles.config.loader import ConfigError, load_config, parse_overrides
from miles.run_config import RunConfig

ENGINE_WEIGHT_FRACTION = 0.6
"""ASSUMED. The default layout gives each engine enough devices that its weights take at most this
share of their memory (the rest is KV cache)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles simulate", description="Project a run's step time, memory per "
                                "device and weight-sync time per transport onto a fleet (docs/scaling.md).")
    p.usage = "miles simulate [CONFIG.toml] [options] [--section.key VALUE ...]"
    p.add_argument("--model-size", help="a size (744B, 1T, 235B) or a preset: " + ", ".join(sorted(PRESETS)))
    p.add_argument("--gpus", type=int, default=64, help="devices in the run (default 64)")
    p.add_argument("--device", default="h100", help=f"{', '.join(DEVICES)}, or cpu (needs a calibration)")
    p.add_argument("--trainer-gpus", type=int, help="devices that train (default: half; all when colocated)")
    p.add_argument("--engine-gpus", type=int, help="devices per engine (default: fewest that hold the weights)")
    p.add_argument("--engines", type=int, help="engines (default: as many as the engine devices hold)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="mean prompt length (default 1024)")
    p.add_argument("--mean-response-fraction", type=float, default=0.5,
                   help="mean response length / rollout.max_new_tokens (default 0.5)")
    p.add_argument("--decode-batch", type=int, default=256, help="sequences one engine decodes together")
    p.add_argument("--delta-density", type=float, help="fraction of bytes one step changes (default 0.02)")
    for key, text in (("memory-gb", "device memory"), ("nic-gbps", "NIC GB/s per device"),
                      ("memory-bw-gbps", "memory bandwidth"), ("nvme-read-gbps", "node NVMe read GB/s"),
                      ("nvme-write-gbps", "node NVMe write GB/s"), ("devices-per-node", "devices per node")):
        p.add_argument(f"--{key}", type=float, help=f"override the device preset's {text}")
    p.add_argument("--calibrate", action="store_true", help="cpu: measure this host with a tiny sync benchmark")
    p.add_argument("--calibrate-from", metavar="FILE", help="cpu: a `miles bench sync` output (its last line)")
    return p


def _run_config(path: str | None, extra: list[str]) -> RunConfig:
    return load_config(RunConfig, path, parse_overrides(extra), validate=False)


def workload(cfg: RunConfig, a) -> projection.Workload:
    r = cfg.rollout
    return projection.Workload(
        prompts_per_step=r.prompts_per_step, samples_per_prompt=r.n_samples_per_prompt,
        prompt_tokens=a.prompt_tokens, max_new_tokens=r.max_new_tokens,
        mean_response_fraction=a.mean_response_fraction, decode_batch=a.decode_batch,
        schedule=cfg.loop.schedule, transport=cfg.sync.transport,
        reference_model=cfg.trainer.algorithm.kl_coef > 0, offload_optimizer=cfg.trainer.offload_optimizer != "none")


def default_layout(shape: ModelShape, device: DeviceSpec, gpus: int, colocated: bool, trainer: int | None,
                   per_engine: int | None, engines: int | None) -> Layout:
    trainer = trainer or (gpus if colocated else gpus // 2)
    pool = gpus if colocated else gpus - trainer
    if per_engine is None:
        per_engine = 1
        while shape.wire_bytes / per_engine > device.memory_gb * GB * ENGINE_WEIGHT_FRACTION and per_engine < pool:
            per_engine *= 2
    engines = engines or max(1, pool // per_engine)
    if trainer < 1 or (not colocated and engines * per_engine > pool):
        raise ConfigError(f"{gpus} devices cannot hold {trainer} trainer devices and {engines} engines of "
                          f"{per_engine}: lower --trainer-gpus, --engines or --engine-gpus, or raise --gpus")
    return Layout(trainer_devices=trainer, engines=engines, devices_per_engine=per_engine, colocated=colocated)


def _table(p: projection.Projection) -> str:
    lay = p.layout
    rows = [f"model {p.model}: BF16 checkpoint {p.checkpoint_bf16_tb:.2f} TB, one update {p.update_tb:.2f} TB",
            f"fleet {p.devices} x {p.device}: trainer {lay['trainer_devices']}, engines {lay['engines']} x "
            f"{lay['devices_per_engine']}{' (colocated)' if lay['colocated'] else ''}",
            f"step {p.step_s:9.1f} s   rollout {p.rollout_s:.1f} s, train {p.train_s:.1f} s, sync {p.sync_s:.1f} s",
            f"memory per device: trainer {p.trainer_memory_gb:.0f} GB, engine weights {p.engine_weights_gb:.0f} GB "
            f"+ KV {p.engine_kv_gb:.0f} GB of {p.device_memory_gb:.0f} GB{'' if p.fits else '  (DOES NOT FIT)'}",
            "weight sync per transport:"]
    rows += [f"  {name:<11} {v['seconds']:8.2f} s   {v['basis']}" for name, v in p.sync_by_transport.items()]
    return "\n".join(rows)


def _cpu(a, cfg: RunConfig) -> dict:
    line = None
    if a.calibrate_from:
        line = calibration.read_bench_line(a.calibrate_from)
        cal = calibration.from_bench(line, source=a.calibrate_from)
    elif a.calibrate:
        cal = calibration.calibrate_here()
    else:
        raise ConfigError("--device cpu needs this host's constants: --calibrate (a tiny benchmark, about a "
                          "minute) or --calibrate-from FILE (a `miles bench sync` output)")
    # Bytes of one update: the bench's default model (8 layers: 256 MiB of bf16) unless a size is given.
    nbytes = parse_size(a.model_size) * 2 if a.model_size else 268_435_456
    engines = a.engines or max(2, cfg.rollout.num_engines)
    out = {"device": "cpu", "calibration": dataclasses.asdict(cal),
           "projected_bench_sync": calibration.project_bench(cal, nbytes, engines)}
    print(f"this host ({cal.source}): memcpy {cal.memcpy_gbps:.2f} GB/s, loopback gloo {cal.gloo_link_gbps:.2f} GB/s")
    for k, v in out["projected_bench_sync"].items():
        if k.endswith("_s"):
            print(f"  {k:<22} {v:8.3f} s  ({nbytes / 2**20:.0f} MiB to {engines} engines)")
    if line and line.get("second"):
        # The bench timed a second model in the same rounds: the projection checked against it.
        out["check_second_model"] = check = calibration.check_projection(line)
        print(f"projected / measured for the bench's second model ({line['second']['bytes'] / 2**20:.0f} MiB), "
              "calibrated on its first, same rounds:")
        for k, ratio in check.items():
            print(f"  {k:<22} {ratio:8.3f}{'' if abs(ratio - 1) <= 0.2 else '  (off by more than 20%)'}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The config file comes first when given; every other word belongs to an option or an override.
    config = argv.pop(0) if argv and not argv[0].startswith("-") else None
    a, extra = _parser().parse_known_args(argv)
    try:
        cfg = _run_config(config, extra)
        if a.device == "cpu":
            out = _cpu(a, cfg)
        else:
            if not a.model_size:
                raise ConfigError("--model-size is needed: a size such as 744B or 1T, or a preset name")
            shape = model_shape(a.model_size)
            device = device_spec(a.device, memory_gb=a.memory_gb, nic_gbps=a.nic_gbps,
                                 memory_bw_gbps=a.memory_bw_gbps, nvme_read_gbps=a.nvme_read_gbps,
                                 nvme_write_gbps=a.nvme_write_gbps,
                                 devices_per_node=int(a.devices_per_node) if a.devices_per_node else None)
            layout = default_layout(shape, device, a.gpus, cfg.placement.mode == "colocated", a.trainer_gpus,
                                    a.engine_gpus, a.engines)
            density = a.delta_density if a.delta_density is not None else weight_sync.DELTA_DENSITY
            proj = projection.project(shape, device, layout, workload(cfg, a), density)
            print(_table(proj))
            out = proj.as_dict()
    except (ConfigError, ValueError) as e:
        sys.exit(f"miles simulate: {e}")
    print(json.dumps(out))
    return 0
