"""metrics.jsonl: one JSON object per step, keys namespaced (`rollout/`, `train/`, `sync/`,
`eval/`, `perf/`, `buffer/`). Appended and flushed per step so a crashed run keeps its history."""

from __future__ import annotations

import json
import math
from pathlib import Path


class JsonlSink:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step}
        for k, v in sorted(metrics.items()):
            v = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            record[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        self._f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
