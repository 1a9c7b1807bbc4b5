"""Weights & Biases mirror of the step records.

Offline mode writes everything under RUN_DIR/wandb and needs no network or account; upload later
with `wandb sync RUN_DIR/wandb/offline-run-*`. System-stats sampling and console capture are off:
the run's own metrics are the point, and capturing stdout would interleave with progress lines.
"""

from __future__ import annotations

from pathlib import Path


class WandbSink:
    def __init__(self, run_dir: str | Path, mode: str, project: str, entity: str | None, name: str,
                 config: dict | None = None):
        import wandb

        self._wandb = wandb
        # Generous start-up timeouts: the wandb service starts while engines and trainer load on the
        # same cores, and a slow start is no reason to lose the run.
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_machine_info=True,
                                  disable_git=True, save_code=False, init_timeout=600, x_service_wait=600)
        self._run = wandb.init(project=project, entity=entity, name=name, dir=str(run_dir), mode=mode,
                               config=config or {}, settings=settings, reinit="create_new")
        self.dir = Path(self._run.dir).parent if self._run.dir else Path(run_dir) / "wandb"

    def write(self, step: int, metrics: dict[str, float]) -> None:
        data = {k: float(v) for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._run.log(data, step=step)

    def close(self) -> None:
        self._run.finish()
