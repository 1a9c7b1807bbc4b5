"""This machine's own constants for the capacity model, from `miles bench sync`.

The CPU "fleet" is one host: engines and trainer are processes, the network is loopback gloo and
shared memory. Its constants are measured, never taken from a spec sheet:

    memcpy_gbps        bytes / memcpy_s                       (one in-memory copy)
    gloo_link_gbps     receivers x bytes / raw_gloo_broadcast_s (gloo's broadcast sends every receiver
                       its own copy from the root, so the root's link carries receivers x bytes)
    broadcast_efficiency, p2p_over_copy, delta_density
                       miles' transports against those primitives, as the full benchmark reports them

A calibration comes from a benchmark's JSON line (`miles bench sync > bench.jsonl`, the last line)
or from `measure()`, a tiny version of the same benchmark: the bench's own bare gloo broadcast to
long-lived receiver processes and its memcpy, at a few sizes, without engines (seconds, not minutes).
`project_bench` then projects the benchmark's figures for another size, and `check_projection`
compares that projection with a second model the benchmark timed in the same rounds
(`miles bench sync --second-layers N`).

Non-goal: projecting a GPU fleet from a CPU measurement (the two share no constant).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from miles.config.loader import ConfigError

GB = 1e9
_NEEDED = ("bytes", "engines", "raw_gloo_broadcast_s", "memcpy_s")


@dataclass(frozen=True)
class CpuCalibration:
    """Constants of this host, measured."""

    memcpy_gbps: float
    """One in-memory copy, GB/s."""
    gloo_link_gbps: float
    """Bytes the root of a loopback gloo broadcast sends per second, all receivers together, GB/s."""
    broadcast_efficiency: float | None = None
    """miles' broadcast transport time / bare gloo's (from a full benchmark line)."""
    p2p_over_copy: float | None = None
    """miles' p2p time / (engines x memcpy), the benchmark's p2p_vs_copy_limit."""
    delta_density: float | None = None
    """Fraction of weight bytes a few RL steps changed (the benchmark's disk-delta run)."""
    source: str = ""
    """Where the figures came from."""


def from_bench(line: str | dict, source: str = "bench line") -> CpuCalibration:
    """A calibration from one `miles bench sync` JSON line (or its parsed object)."""
    if isinstance(line, str):
        try:
            line = json.loads(line.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise ConfigError(f"{source}: not a `miles bench sync` JSON line; run `miles bench sync > bench.jsonl` "
                              "and pass that file") from None
    missing = [k for k in _NEEDED if k not in line]
    if missing:
        raise ConfigError(f"{source}: a `miles bench sync` line needs {', '.join(_NEEDED)}; "
                          f"{', '.join(missing)} missing")
    nbytes, engines = float(line["bytes"]), int(line["engines"])
    eff = line.get("broadcast_efficiency")
    return CpuCalibration(
        memcpy_gbps=nbytes / line["memcpy_s"] / GB,
        gloo_link_gbps=engines * nbytes / line["raw_gloo_broadcast_s"] / GB,
        broadcast_efficiency=float(eff) if eff else None,
        p2p_over_copy=line.get("p2p_vs_copy_limit"),
        delta_density=line.get("delta_density"),
        source=source)


def read_bench_line(path: str) -> dict:
    """The last line of a `miles bench sync` output file, parsed."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--calibrate-from {path!r} not found: run `miles bench sync > {path}` first")
    try:
        return json.loads(p.read_text().strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise ConfigError(f"{path}: not a `miles bench sync` JSON line; run `miles bench sync > bench.jsonl` "
                          "and pass that file") from None


def read_bench_file(path: str) -> CpuCalibration:
    return from_bench(read_bench_line(path), source=path)


CHECKED = ("broadcast_s", "p2p_s", "raw_gloo_broadcast_s", "memcpy_s")
"""The benchmark's figures a projection is checked on: miles' two network-shaped transports and the
two primitives they are measured against."""


def check_projection(line: dict) -> dict[str, float]:
    """Projected / measured for each CHECKED figure of the line's second model (`miles bench sync
    --second-layers N`), calibrated on its first model. Both models ran each method back to back in
    every round, so each round calibrates on the first and is checked on the second under one load;
    the median over rounds is reported (1.0 = exact)."""
    second, runs = line.get("second"), line.get("raw_runs")
    if not second or not runs:
        raise ConfigError("the bench line has no second model: run `miles bench sync --second-layers N` to "
                          "check the projection against a measurement taken in the same rounds")
    ratios: dict[str, list[float]] = {k: [] for k in CHECKED}
    for i in range(min(len(runs["raw"]), len(second["raw_runs"]["raw"]))):
        first_round = _round(line, i)
        projected = project_bench(from_bench(first_round, source=f"round {i}"), second["bytes"], second["engines"])
        measured = _round(second, i)
        for k in CHECKED:
            ratios[k].append(projected[k] / measured[k])
    return {k: round(statistics.median(v), 3) for k, v in ratios.items()}


def _round(line: dict, i: int) -> dict:
    """Round `i` of a bench line, shaped like a bench line."""
    runs, engines = line["raw_runs"], int(line["engines"])
    bc, raw, p2p, copy = (runs[k][i] for k in ("broadcast", "raw", "p2p", "memcpy"))
    return {"bytes": line["bytes"], "engines": engines, "broadcast_s": bc, "raw_gloo_broadcast_s": raw,
            "memcpy_s": copy, "p2p_s": p2p, "broadcast_efficiency": raw / bc,
            "p2p_vs_copy_limit": p2p / (engines * copy)}


def project_bench(cal: CpuCalibration, nbytes: float, engines: int = 2) -> dict[str, float]:
    """The benchmark's figures for `nbytes` of weights pushed to `engines` engines on this host."""
    raw = engines * nbytes / (cal.gloo_link_gbps * GB)
    copy = nbytes / (cal.memcpy_gbps * GB)
    out = {"bytes": nbytes, "engines": engines, "raw_gloo_broadcast_s": raw, "memcpy_s": copy}
    if cal.broadcast_efficiency:
        out["broadcast_s"] = raw / cal.broadcast_efficiency
    if cal.p2p_over_copy:
        out["p2p_s"] = engines * copy * cal.p2p_over_copy
    return out


def _sync_bench():
    """benchmarks/sync.py, loaded as `miles bench` loads it (the benchmarks live beside the package)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sync.py"
    if not path.is_file():
        raise ConfigError(f"the sync benchmark is not at {path}: --calibrate needs a source checkout; "
                          "or pass --calibrate-from with a `miles bench sync` line")
    spec = importlib.util.spec_from_file_location("miles_bench_sync", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(bucket_bytes: int = 96 << 20, buckets: int = 2, receivers: int = 2,
            rounds: int = 5) -> list[tuple[dict, dict]]:
    """The tiny benchmark, without engines: the bench's bare gloo broadcast to `receivers` long-lived
    processes and its memcpy, for a model of one bucket and for one of `buckets` buckets, both in every
    round (adjacent in time, so a busy neighbour slows them alike; memcpy in the copying thread's CPU
    time), after one warm-up round.
    Returns per round (one-bucket figures, `buckets`-bucket figures), each shaped like a bench line.
    Buckets are three times this host's 32 MiB last-level cache, so a copy streams from memory as the
    bench's do (at 48 MiB the one-bucket copy ran about 15% faster per byte than a three-bucket one)."""
    import time

    import torch

    bench = _sync_bench()
    half = bucket_bytes // 2
    named = [(f"w{i}", torch.ones(half, dtype=torch.bfloat16)) for i in range(buckets + 1)]
    raw = bench.RawGloo(named, bucket_bytes, receivers, rounds=rounds + 1)  # one flat per tensor
    out = []
    try:
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            raw.pg.broadcast([raw.flats[0]]).wait()
            one = time.perf_counter() - t0
            t0 = time.perf_counter()
            for flat in raw.flats[1:]:
                raw.pg.broadcast([flat]).wait()
            raw.pg.allreduce([torch.zeros(1)]).wait()  # every receiver has every byte (the round's end)
            many = time.perf_counter() - t0
            # The copies in CPU time of the copying thread: a copy is short, and on a loaded host the
            # wall clock mostly measures who else got the core (on an idle one the two agree).
            copy_one = bench.memcpy(named[:1], clock=time.thread_time)
            copy_many = bench.memcpy(named[1:], clock=time.thread_time)
            if r:  # round 0 maps the buffers' pages
                out.append(({"bytes": 2 * half, "engines": receivers, "raw_gloo_broadcast_s": one,
                             "memcpy_s": copy_one},
                            {"bytes": 2 * half * buckets, "engines": receivers, "raw_gloo_broadcast_s": many,
                             "memcpy_s": copy_many}))
        raw.close()
    finally:
        raw.stop()
    return out


def calibrate_here(rounds: int = 5) -> CpuCalibration:
    """A calibration from the tiny benchmark: the median round of the one-bucket figures."""
    ones = [one for one, _ in measure(rounds=rounds)]
    med = {k: sorted(o[k] for o in ones)[len(ones) // 2] for k in ("raw_gloo_broadcast_s", "memcpy_s")}
    return from_bench({**ones[0], **med}, source="tiny sync benchmark on this host")
