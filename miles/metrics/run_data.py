"""A run directory as the report and the dashboard read it: its step records, config and summary.

Reads only files (metrics.jsonl, config.json, summary.json), so it works on a run that is still going
and on a copy from another machine; a torn last line becomes a warning, not an error. The derived
series that both the plots and the summary show (staleness histogram, buffer ledger totals) live
here so the two agree. Non-goals: drawing, formatting, writing anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from miles.metrics.sink import MetricsFileError, read_metrics


class ReportError(ValueError):
    """The run directory cannot be reported on; the message says why and what to pass instead."""


@dataclass
class Run:
    """One run's records (sorted by step) with the files beside them; `name` labels it in plots."""

    name: str
    path: Path
    records: list[dict]
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the records that carry `key` with a number."""
        xs, ys = [], []
        for r in self.records:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                xs.append(r["step"])
                ys.append(float(v))
        return xs, ys

    def keys(self, prefix: str) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.records:
            for k in r:
                if k.startswith(prefix):
                    seen[k] = None
        return list(seen)

    @property
    def step_records(self) -> list[dict]:
        """Records of training steps (step 0 is the evaluation before training)."""
        return [r for r in self.records if r["step"] > 0 and "perf/step_s" in r]


def load_run(path: str | Path) -> Run:
    """The run at `path`; ReportError (naming what to pass instead) when it is not a run or has no records."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path} is not a directory; pass the run directory printed by `miles train` "
                          f"(e.g. runs/<name>)")
    warnings: list[str] = []
    try:
        records = read_metrics(path / "metrics.jsonl", warn=warnings.append)
    except MetricsFileError as e:
        raise ReportError(str(e)) from None
    if not records:
        raise ReportError(f"{path}/metrics.jsonl has no records yet; wait for the run's first evaluation")
    records.sort(key=lambda r: r["step"])

    def read_json(name: str) -> dict:
        p = path / name
        if not p.is_file():
            return {}
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError:
            warnings.append(f"{p} is not valid JSON; ignored")
            return {}

    return Run(path.name, path, records, read_json("config.json"), read_json("summary.json"), warnings)


def staleness_hist(run: Run) -> dict[int, float]:
    """{versions behind: groups} over the whole run, from the per-step `buffer/staleness/<n>` counts."""
    hist: dict[int, float] = {}
    for k in run.keys("buffer/staleness/"):
        try:
            v = int(k.rsplit("/", 1)[1])
        except ValueError:
            continue
        hist[v] = sum(run.series(k)[1])
    return dict(sorted(hist.items()))


# The buffer's ledger reports running totals per prompt (`buffer/drawn`, `buffer/trained`,
# `buffer/pending`, `buffer/discarded_<reason>`, `buffer/retried_<reason>`); a loop without the
# buffer reports per-step counts (`buffer/groups_*`) instead, which are summed up here.
LEDGER_TOTALS = ("buffer/drawn", "buffer/trained", "buffer/pending")


def ledger_series(run: Run) -> dict[str, tuple[list[int], list[float]]]:
    """{label: (steps, running total)} of the buffer ledger."""
    keys = [k for k in LEDGER_TOTALS if run.series(k)[0]]
    keys += sorted(k for k in run.keys("buffer/discarded_") + run.keys("buffer/retried_"))
    if keys:
        return {k.removeprefix("buffer/"): run.series(k) for k in keys}
    out = {}
    for k in run.keys("buffer/groups_"):
        xs, ys = run.series(k)
        total, cum = 0.0, []
        for y in ys:
            total += y
            cum.append(total)
        out[k.removeprefix("buffer/groups_")] = (xs, cum)
    return out
