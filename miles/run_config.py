"""The root run config: the composition root of a run's settings, beside the CLI that loads it.

It composes every component's own config (each a dataclass next to what it configures), and the
run's own sections (run_sections.py: loop, placement, ray, fault), into the one
tree a run TOML and `--section.key` overrides fill in, checks combinations of sections
(run_checks.py), and resolves what one section derives from another (the wire dtype from the
engines' dtype) without writing it back, so the saved config.json is exactly what was asked for.
Components never import this module; the entry points (cli.py, the driver, `miles eval`) hand each
component its own section. Non-goals: loading and typing TOML (config/loader.py), defaults beyond
the sections' own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from miles.buffer.data_buffer import BufferConfig
from miles.config.loader import ConfigError
from miles.eval.config import EvalConfig
from miles.metrics.sink import MetricsConfig
from miles.models.loading import check_model_path
from miles.rollout.config import RolloutConfig
from miles.rollout.liveness import HealthConfig
from miles.rollout.router.config import RunRouterConfig
from miles.rollout.teacher import TeacherConfig
from miles.run_checks import check_run
from miles.run_sections import FaultConfig, LoopConfig, PlacementConfig, RayConfig
from miles.sync.prepare import SyncConfig
from miles.trainer.config import TrainerConfig
from miles.trainer.sft import SFTConfig


@dataclass
class RunSection:
    name: str = "run"
    """Run name; the run directory is output_dir/name (a suffix is added if it exists)."""
    output_dir: str = "runs"
    """Parent folder of run directories."""
    seed: int = 0
    """Seed for prompt order, sampling and initialisation."""

    def validate(self) -> None:
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise ConfigError(f"run.name {self.name!r} must be one folder name (no '/'): e.g. run.name = 'grpo-1'")
        # The run directory is made only after Ray and the engines start; a path that can never be a
        # folder is refused now. The nearest existing ancestor is what decides.
        out = Path(self.output_dir)
        for p in (out, *out.absolute().parents):
            try:
                if not p.exists():
                    continue
            except OSError as e:
                raise ConfigError(f"run.output_dir {self.output_dir!r}: {str(p)!r} cannot be read ({e.strerror}); "
                                  "point run.output_dir at a folder you can write") from None
            if not p.is_dir():
                raise ConfigError(f"run.output_dir {self.output_dir!r}: {str(p)!r} is a file, not a folder; "
                                  "point run.output_dir at a folder (it is created if missing)")
            break


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face checkpoint directory (or hub id) of the policy to train."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("model.path is required: set it in the TOML [model] table or pass --model.path DIR")
        try:
            check_model_path(self.path)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"model.path: {e}") from None


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    """Naming, output location and seed."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy checkpoint."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Ray cluster to use."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Where engines and trainer run."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    """Schedule and step counts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Engines, sampling, prompts and rewards."""
    router: RunRouterConfig = field(default_factory=RunRouterConfig)
    """The router in front of the engines (miles train runs the built-in one)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Engine liveness (the router's quarantine and the fleet's probes), replacement of dead or stalled
    engines, standby engines."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Fault injection: kill or stall engines, drop replies, delay weight sync, kill a trainer rank."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """Data buffer between rollout and trainer: filters, staleness, retries, capacity."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer backend, optimizer and algorithm."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """Teacher engines for on-policy distillation (the alternative to trainer.algorithm.opd.teacher_path)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight sync from trainer to engines."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start (used by `miles sft`)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric sinks, progress display and the live dashboard."""

    def validate(self) -> None:
        check_run(self)

    def wire_dtype(self) -> str | None:
        """The dtype weights travel in: sync.dtype, else the built-in engines' own dtype when it is not fp32
        (engines hold what they were loaded as; shipping fp32 to bf16 engines would double the bytes and
        make verification compare fp32 checksums with bf16 tensors), else the trainer's dtype (None)."""
        if self.sync.dtype is None and not self.rollout.engine_urls and self.rollout.engine.dtype != "float32":
            return self.rollout.engine.dtype
        return self.sync.dtype
