"""Generation statistics between two reports: samples, tokens, rewards, truncation, group times.

Metric names are stable (`rollout/...`, `perf/reward_s`) so plots and dashboards keep working.
Non-goal: buffer and ledger figures (the buffer reports its own).
"""

from __future__ import annotations

import contextlib
import time


class SampleStats:
    """Figures accumulated between two reports (thread-safe enough: one writer thread)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.samples = self.tokens = self.truncated = self.groups = self.zero_std = 0
        self.reward = 0.0
        # Wall seconds during which at least one group was being scored. Groups score concurrently,
        # so a sum of per-group latencies would exceed the rollout's own wall time.
        self.reward_s = 0.0
        self._scoring, self._scoring_since = 0, 0.0
        self.group_s: list[float] = []

    @contextlib.contextmanager
    def scoring(self):
        """Around one group's reward calls (on the event loop's thread)."""
        if self._scoring == 0:
            self._scoring_since = time.perf_counter()
        self._scoring += 1
        try:
            yield
        finally:
            self._scoring -= 1
            if self._scoring == 0:
                self.reward_s += time.perf_counter() - self._scoring_since

    def add(self, group, seconds: float) -> None:
        self.groups += 1
        self.zero_std += len(set(group.rewards)) == 1
        self.group_s.append(seconds)
        for s in group.samples:
            self.samples += 1
            self.tokens += len(s.response_ids)
            self.truncated += s.status.value == "truncated"
            self.reward += s.reward

    def metrics(self, elapsed: float | None) -> dict[str, float]:
        elapsed = elapsed if elapsed is not None else time.perf_counter() - self.t0
        n = max(self.samples, 1)
        out = {"rollout/samples": float(self.samples), "rollout/time_s": elapsed,
               "rollout/samples_per_s": self.samples / max(elapsed, 1e-9),
               "rollout/tokens_per_s": self.tokens / max(elapsed, 1e-9), "perf/reward_s": self.reward_s}
        if self.samples:
            out.update({"rollout/reward_mean": self.reward / n, "rollout/response_len_mean": self.tokens / n,
                        "rollout/truncated_frac": self.truncated / n,
                        "rollout/zero_std_group_frac": self.zero_std / max(self.groups, 1),
                        "rollout/group_time_max_s": max(self.group_s)})
        return out
