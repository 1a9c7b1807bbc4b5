"""The pieces of scripts/gpu-check.sh that are Python: probe the device, watch a run's GPU, time the
trainer against a plain loop, and fold every part's output into one JSON line.

  check.py probe OUT.json                      the GPU's name, memory, measured copy bandwidth and how
                                               float32 products round (TF32 or float32)
  check.py watch OUT.json METRICS -- CMD...    run CMD, sampling GPU utilisation; each step's window is
                                               read off METRICS (metrics.jsonl) as its lines appear
  check.py build-model PRESET DIR              a preset built on the GPU (fast for large shapes)
  check.py report DIR                          one JSON line from DIR's parts

Runs on CPU too (small sizes, utilisation absent), so the script's plumbing is checked off the GPU.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks` beside `miles`
from benchmarks import gpu as bench  # noqa: E402 - found through the line above


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def probe(out: str) -> None:
    import torch

    info = {"torch": torch.__version__, "cuda": _cuda(), "date": time.strftime("%Y-%m-%d")}
    if _cuda():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, memory_gib=round(p.total_memory / 2**30, 1),
                    copy_gb_s=round(bench.copy_bandwidth("cuda") / 1e9, 1))  # bytes read + written
        # How float32 multiplies here: as the image leaves torch (TF32 if it sets the override), and as
        # miles' processes do after devices.exact_float32 (in a process of its own: the override is read once).
        info["fp32_matmul"] = {"override": os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"),
                               "precision": torch.get_float32_matmul_precision(),
                               "rel_err_image": _matmul_error(), "rel_err_miles": _matmul_error_exact()}
    Path(out).write_text(json.dumps(info))


def _matmul_error_exact() -> float | None:
    """_matmul_error after miles' exact_float32, in a fresh process (None if that process failed)."""
    r = subprocess.run([sys.executable, __file__, "matmul-error", "exact"], capture_output=True, text=True)
    try:
        return float(r.stdout)
    except ValueError:
        print(f"check.py: matmul-error failed: {r.stderr[-500:]}", file=sys.stderr)
        return None


def _matmul_error(exact: bool = False) -> float:
    """Relative error of a 1024 x 1024 float32 product on the GPU against float64: about 1e-7 in float32,
    about 1e-4 in TF32."""
    import torch

    if exact:
        from miles.devices import exact_float32

        exact_float32()
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(1024, 1024, device="cuda", generator=g) for _ in range(2))
    ref = a.double() @ b.double()
    return float(((a @ b).double() - ref).norm() / ref.norm())


class _Utilisation:
    """GPU utilisation (% of time a kernel ran, as NVML reports it) sampled every 50 ms with unix times."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
        except Exception:  # no GPU, or no NVML: the run still runs, without utilisation
            self._handle = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            u = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            self.samples.append((time.time(), float(u)))

    def __enter__(self):
        if self._handle is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


def watch(out: str, metrics: str, cmd: list[str]) -> int:
    """Run `cmd`; note when each line of `metrics` appears (a step's end), sample the GPU meanwhile, and
    poll the engine the run prints ("engines ready: URL") for its counters. `out` is rewritten after
    every step, so a run cut short still leaves what it measured."""
    import re
    import urllib.request

    seen: list[tuple[float, dict]] = []
    engine: dict = {"url": None, "stats": None}
    t0 = time.time()

    def tee(stream) -> None:  # the run's output, passed through, watched for the engine's URL
        for line in stream:
            sys.stdout.write(line)
            m = re.search(r"engines ready[^:]*: (http://[^\s,;]+)", line)
            if m and engine["url"] is None:
                engine["url"] = m.group(1)

    def poll_engine() -> None:
        if engine["url"]:
            try:
                with urllib.request.urlopen(engine["url"] + "/get_server_info", timeout=2) as r:
                    engine["stats"] = json.loads(r.read())["engine_stats"]
            except (OSError, ValueError, KeyError):
                pass

    def write(rc) -> None:
        steps = []
        for end, rec in seen:
            if "perf/step_s" not in rec:
                continue
            start = end - rec["perf/step_s"]
            inside = [u for t, u in util.samples if start <= t <= end]
            steps.append({"step": rec["step"], **{k: v for k, v in rec.items() if k.startswith(("perf/", "sync/"))},
                          "gpu_busy": round(sum(inside) / len(inside) / 100, 3) if inside else None})
        Path(out).write_text(json.dumps({"rc": rc, "wall_s": round(time.time() - t0, 1), "steps": steps,
                                         "engine_stats": engine["stats"]}))

    with _Utilisation() as util:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=tee, args=(proc.stdout,), daemon=True).start()
        pos, last_poll = 0, 0.0
        while proc.poll() is None:
            time.sleep(0.05)
            if time.time() - last_poll > 2:
                poll_engine()
                last_poll = time.time()
            if os.path.exists(metrics):
                with open(metrics) as f:
                    f.seek(pos)
                    for line in f:
                        if not line.endswith("\n"):
                            break
                        seen.append((time.time(), json.loads(line)))
                        pos += len(line.encode())
                        poll_engine()
                        write(None)
    write(proc.returncode)
    return proc.returncode


def build_model(preset: str, out: str) -> None:
    """A preset built with the GPU as torch's default device: a 0.6B shape initialises in seconds."""
    bench.build_model(preset, "cuda" if _cuda() else "cpu", out)


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pytest(log: Path) -> dict:
    text = log.read_text() if log.exists() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)\b", text)}
    return {**counts, "failures": re.findall(r"^FAILED (\S+)", text, re.M)[:10]}


def _records(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per complete line: a part killed by its time limit may leave a
    last line half written, which is left out."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line] if path.exists() else []


def _evals(recs: list[dict]) -> dict:
    """Eval accuracy before and after RL from a run's records (the first and last eval records)."""
    acc = [r for r in recs if any(k.startswith("eval/") and k.endswith("accuracy") for k in r)]
    key = next((k for k in (acc[0] if acc else {}) if k.startswith("eval/") and k.endswith("accuracy")), None)
    if not key:
        return {}
    return {"eval_key": key, "before": acc[0][key], "after": acc[-1][key],
            "gain_points": round(100 * (acc[-1][key] - acc[0][key]), 1)}


def _sft(log: Path) -> dict:
    """The warm start of the main job, from its part's log: `miles sft`'s summary (steps, held-out
    accuracy, seconds) and its held-out accuracy along the way (every 100th step and the last check),
    so a part cut short still says where SFT was."""
    text = log.read_text() if log.exists() else ""
    summary = {}
    for line in text.splitlines():
        if line.startswith("{") and '"reached_target"' in line:
            rec = json.loads(line)
            summary = {"steps": rec.get("steps"), "held_out_accuracy": rec.get("held_out_accuracy"),
                       "reached_target": rec.get("reached_target"), "s": round(rec.get("wall_time_s", 0.0), 1)}
    checks = [(int(n), float(a)) for n, a in re.findall(r"^\[sft\] (\d+)/\d+ .*?accuracy=([0-9.]+)", text, re.M)]
    kept = [c for c in checks if c[0] % 100 == 0] + checks[-1:]
    return {**summary, "accuracy_by_step": sorted(set(kept))} if summary or checks else {}


def _grpo(recs: list[dict]) -> dict:
    """The RL phase of the main job, from its records: steps done and the median seconds of a step and
    its parts."""
    steps = [r for r in recs if r.get("step", 0) > 0 and "perf/step_s" in r]
    med = {k.split("/")[1]: round(statistics.median(r[k] for r in steps if k in r), 3)
           for k in ("perf/step_s", "perf/rollout_s", "perf/train_s", "perf/sync_s", "perf/eval_s")
           if any(k in r for r in steps)}
    return {"steps_done": len(steps), "median_s": med} if steps else {}


def report(root: str) -> None:
    d = Path(root)
    out = {"check": "gpu", "device": _read(d / "device.json"), "cuda_tests": _pytest(d / "pytest-cuda.log"),
           "megatron_tests": _pytest(d / "megatron.log")}
    arith = _read(d / "arithmetic-time.json") or {}
    run_dirs = sorted((d / "arithmetic").glob("grpo*")) if (d / "arithmetic").exists() else []
    recs = _records(run_dirs[-1]) if run_dirs else []
    out["arithmetic"] = {**arith, **_evals(recs), "sft": _sft(d / "arithmetic.log"), "grpo": _grpo(recs)}
    rl = _read(d / "rl-watch.json") or {}
    steps = rl.get("steps", [])
    later = steps[1:] or steps  # the first step pays for warm-up (allocator, kernels)
    busy = [s["gpu_busy"] for s in later if s.get("gpu_busy") is not None]
    out["rl_0.6b"] = {**{k: v for k, v in rl.items() if k != "steps"}, "steps": steps,
                      "gpu_busy_after_step1": round(sum(busy) / len(busy), 3) if busy else None}
    bench = [json.loads(line) for line in (d / "bench-gpu.log").read_text().splitlines() if line.startswith('{"bench"')] \
        if (d / "bench-gpu.log").exists() else []
    out["decode_vs_hf"] = bench[-1].get("decode") if bench else None
    out["trainer_vs_plain"] = bench[-1].get("trainer") if bench else None
    out["sections"] = _read(d / "sections.json")
    print(json.dumps(out))


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    if cmd == "probe":
        probe(*args)
    elif cmd == "watch":
        split = args.index("--")
        return watch(args[0], args[1], args[split + 1:])
    elif cmd == "build-model":
        build_model(*args)
    elif cmd == "report":
        report(*args)
    elif cmd == "matmul-error":  # probe's second measurement, in a fresh process
        print(_matmul_error(exact=args == ["exact"]))
    else:
        sys.exit(f"check.py: unknown command {cmd!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
