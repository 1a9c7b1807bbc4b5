"""TensorBoard mirror of the step records: numeric values become scalars under the same names,
so the `rollout/`, `train/`, ... namespaces show up as TensorBoard's sections."""

from __future__ import annotations

from pathlib import Path


class TensorBoardSink:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._writer.add_scalar(k, float(v), global_step=step)
        # Flushed per step: people open TensorBoard on a run that is still going.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
