"""Metric sinks: where each step's record goes.

`metrics.jsonl` in the run directory is always written: one JSON object per step, keys namespaced
(`rollout/`, `train/`, `sync/`, `buffer/`, `eval/`, `perf/`), appended and flushed per step so a
crashed run keeps its history and `miles report` / the dashboard can read it while the run goes on.
TensorBoard and Weights & Biases are optional mirrors of the same records, chosen by config.
Non-goal: aggregation across steps (plots and the report do that from metrics.jsonl).
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from miles.config import ConfigError
from miles.metrics.tensorboard_sink import TensorBoardSink
from miles.metrics.wandb_sink import WandbSink


@dataclass
class MetricsConfig:
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard."""
    wandb: Literal["off", "offline", "online"] = "off"
    """Weights & Biases logging: off, offline (files under RUN_DIR/wandb, no network) or online."""
    wandb_project: str = "miles"
    """W&B project name."""
    wandb_entity: str | None = None
    """W&B entity (team or user); None uses your default."""
    progress: Literal["auto", "live", "plain", "off"] = "auto"
    """Progress display: live (redrawn line) on a terminal, plain lines in logs/CI; auto picks."""
    dashboard: bool = False
    """Serve a live dashboard page with the run's plots while the driver runs."""
    dashboard_host: str = ""
    """Address the dashboard binds to; empty: the address of the driver's Ray node (loopback in a local run)."""
    dashboard_port: int = 0
    """Dashboard port (0 = any free port; the URL is printed at start)."""

    def validate(self) -> None:
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("metrics.tensorboard = true needs the tensorboard package: "
                              "pip install 'miles[tensorboard]' or set metrics.tensorboard = false")
        if self.wandb != "off" and importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"metrics.wandb = {self.wandb!r} needs the wandb package: "
                              "pip install 'miles[wandb]' or set metrics.wandb = 'off'")
        if not 0 <= self.dashboard_port < 65536:
            raise ConfigError("metrics.dashboard_port must be in 0..65535 (0 picks a free port)")


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def clean(metrics: dict) -> dict:
    """JSON-safe values: numbers as floats, NaN/inf as None (JSON has no NaN), other values kept."""
    out = {}
    for k, v in sorted(metrics.items()):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = float(v)
            if not math.isfinite(v):
                v = None
        elif hasattr(v, "item"):  # a 0-d tensor or numpy scalar that slipped through
            v = float(v.item())
        out[k] = v
    return out


class JsonlSink:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._f.write(json.dumps({"step": step, **clean(metrics)}) + "\n")

    def close(self) -> None:
        self._f.close()


class Sinks:
    """Fans one record out to every configured sink; used wherever a single sink was."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for s in self.sinks:
            s.write(step, metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def open_sinks(cfg: MetricsConfig, run_dir: str | Path, run_name: str = "run", config: dict | None = None) -> Sinks:
    """metrics.jsonl always, plus TensorBoard / W&B as configured."""
    run_dir = Path(run_dir)
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl")]
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if cfg.wandb != "off":
        sinks.append(WandbSink(run_dir, cfg.wandb, cfg.wandb_project, cfg.wandb_entity, run_name, config))
    return Sinks(sinks)


class MetricsFileError(ValueError):
    """metrics.jsonl is missing or unreadable; the message says which file and why."""


def read_metrics(path: str | Path, warn=None) -> list[dict]:
    """Records of a metrics.jsonl. A torn last line (the run was killed mid-write) is skipped with a
    warning; a bad line in the middle is an error, since it means the file was damaged."""
    path = Path(path)
    if not path.is_file():
        raise MetricsFileError(f"{path} not found: a run directory written by `miles train` has a metrics.jsonl")
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                if warn is not None:
                    warn(f"{path}: skipped a torn last line (the run stopped mid-write)")
                continue
            raise MetricsFileError(f"{path}:{i + 1} is not valid JSON; the file is damaged") from None
        if not isinstance(rec, dict) or "step" not in rec:
            raise MetricsFileError(f"{path}:{i + 1} is not a step record (needs a 'step' key)")
        records.append(rec)
    return records
