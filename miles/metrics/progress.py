"""Progress lines for long work: one short line per step on stderr, readable in CI logs too."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()

    def update(self, done: int, **fields: float | str) -> None:
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - done)
        parts = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        self.stream.write(f"[{self.label}] {done}/{self.total} {parts} | {elapsed:.0f}s elapsed, ~{eta:.0f}s left\n")
        self.stream.flush()
