"""`miles report RUN_DIR [OTHER_RUN_DIR]`: plots and a markdown summary of finished (or running) runs.

Reads only the run directory (metrics.jsonl, config.json, summary.json), so it works on a run that
is still going, on a copy from another machine, and on two runs side by side. Writes PNGs and
summary.md to RUN_DIR/report/ (or RUN_DIR/report-vs-OTHER/ for two runs; --out to choose).
The live dashboard draws its pictures with the same functions. Non-goal: interactive plots.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

PLOTS = ("reward", "step_time", "staleness", "buffer", "throughput")

# One colour per step-time part, fixed so two reports (and two runs) read the same way.
PART_COLORS = {
    "rollout": "#4C72B0", "wait for data": "#4C72B0", "reward": "#64B5CD",
    "train forward": "#DD8452", "train backward": "#C44E52", "train optimizer": "#8C564B", "train other": "#E7A98B",
    "sync prepare": "#55A868", "sync transport": "#2CA02C", "sync apply": "#98DF8A", "sync verify": "#BCBD22",
    "sync other": "#CFE8C0", "eval": "#8172B3", "other": "#BBBBBB",
}
RUN_STYLES = ("-", "--")


class ReportError(ValueError):
    """The run directory cannot be reported on; the message says why and what to pass instead."""


@dataclass
class Run:
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
    from miles.metrics.sink import MetricsFileError, read_metrics

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


# -- plots ----------------------------------------------------------------------------------------
def _figure(ncols: int = 1, width: float = 7.0, height: float = 4.0):
    from matplotlib.figure import Figure

    # Figure without pyplot: no global state, so the dashboard can draw from its server threads.
    fig = Figure(figsize=(width * ncols if ncols > 1 else width, height), dpi=100, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    lo, hi = ax.get_xlim()
    if hi - lo < 2:  # one point: widen the view so the locator has whole numbers to show
        mid = (lo + hi) / 2
        ax.set_xlim(mid - 1, mid + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, even for 2 of them


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center", transform=ax.transAxes, color="#777777")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_reward(runs: list[Run]):
    fig, (ax_r, ax_e) = _figure(2, 5.5)
    for i, run in enumerate(runs):
        style = RUN_STYLES[i % 2]
        xs, ys = run.series("rollout/reward_mean")
        if xs:
            ax_r.plot(xs, ys, style, marker=".", label=run.name)
        xs, ys = run.series("eval/accuracy")
        if xs:
            ax_e.plot(xs, ys, style, marker="o", label=run.name)
    for ax, title, what in ((ax_r, "rollout reward (mean)", "rollout reward"), (ax_e, "eval accuracy", "eval")):
        if not ax.lines:
            _no_data(ax, what)
            continue
        ax.set_title(title)
        ax.set_xlabel("step")
        _integer_steps(ax)
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend()
    return fig


def plot_step_time(runs: list[Run]):
    from miles.metrics.timers import breakdown

    fig, axes = _figure(len(runs), 7.0 if len(runs) == 1 else 5.5)
    top = 0.0
    for ax, run in zip(axes, runs):
        recs = run.step_records
        if not recs:
            _no_data(ax, "step timings")
            continue
        parts = [breakdown(r) for r in recs]
        steps = [r["step"] for r in recs]
        labels = [k for k in PART_COLORS if any(p.get(k, 0) > 0 for p in parts)]
        bottom = [0.0] * len(recs)
        for label in labels:
            vals = [p.get(label, 0.0) for p in parts]
            ax.bar(steps, vals, bottom=bottom, color=PART_COLORS[label], label=label, width=0.8)
            bottom = [b + v for b, v in zip(bottom, vals)]
        top = max(top, max(bottom))
        ax.set_title(f"step time breakdown — {run.name}" if len(runs) > 1 else "step time breakdown")
        ax.set_xlabel("step")
        _integer_steps(ax)
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if len(runs) > 1 and top > 0:
        for ax in axes:
            ax.set_ylim(0, top * 1.05)  # the same scale, so the two runs compare at a glance
    return fig


def staleness_hist(run: Run) -> dict[int, float]:
    hist: dict[int, float] = {}
    for k in run.keys("buffer/staleness/"):
        try:
            v = int(k.rsplit("/", 1)[1])
        except ValueError:
            continue
        hist[v] = sum(run.series(k)[1])
    return dict(sorted(hist.items()))


def plot_staleness(runs: list[Run]):
    fig, (ax,) = _figure(1, 6.0)
    width = 0.8 / len(runs)
    drawn = False
    for i, run in enumerate(runs):
        hist = staleness_hist(run)
        if not hist:
            continue
        drawn = True
        xs = [k + (i - (len(runs) - 1) / 2) * width for k in hist]
        ax.bar(xs, list(hist.values()), width=width, label=run.name)
    if not drawn:
        # No per-group counts: show the buffer's per-step mean and max instead, if it reported them.
        for i, run in enumerate(runs):
            for key, label in (("buffer/staleness_mean", "mean"), ("buffer/staleness_max", "max")):
                xs, ys = run.series(key)
                if xs:
                    ax.plot(xs, ys, RUN_STYLES[i % 2], marker=".", label=label + (f" ({run.name})" if len(runs) > 1 else ""))
        if not ax.lines:
            _no_data(ax, "staleness figures")
            return fig
        ax.set_title("staleness of trained groups per step")
        ax.set_xlabel("step")
        _integer_steps(ax)
        ax.set_ylabel("policy versions behind")
        ax.legend()
        return fig
    ax.set_title("staleness of collected groups")
    ax.set_xlabel("policy versions behind when trained")
    ax.set_ylabel("groups")
    ax.set_xticks(sorted({k for run in runs for k in staleness_hist(run)}))
    if len(runs) > 1:
        ax.legend()
    return fig


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


def plot_buffer(runs: list[Run]):
    fig, (ax,) = _figure(1, 7.0)
    colors: dict[str, str] = {}
    palette = ["#333333", "#55A868", "#8172B3", "#C44E52", "#DD8452", "#4C72B0", "#DA8BC3", "#937860", "#8C8C8C"]
    for i, run in enumerate(runs):
        for label, (xs, ys) in ledger_series(run).items():
            color = colors.setdefault(label, palette[len(colors) % len(palette)])
            ax.plot(xs, ys, RUN_STYLES[i % 2], color=color, label=label + (f" ({run.name})" if len(runs) > 1 else ""))
    if not ax.lines:
        _no_data(ax, "buffer ledger counters")
        return fig
    ax.set_title("buffer ledger (prompts/groups so far)")
    ax.set_xlabel("step")
    _integer_steps(ax)
    ax.set_ylabel("groups")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_throughput(runs: list[Run]):
    fig, (ax_t, ax_i) = _figure(2, 5.5)
    series = (("rollout/tokens_per_s", "generated tokens/s"), ("perf/goodput_tokens_per_s", "goodput (loss tokens/s)"),
              ("rollout/samples_per_s", "samples/s"))
    idle = (("perf/engine_idle_frac", "engines idle"), ("perf/trainer_idle_frac", "trainer idle"))
    for i, run in enumerate(runs):
        suffix = f" ({run.name})" if len(runs) > 1 else ""
        for ax, keys in ((ax_t, series), (ax_i, idle)):
            for j, (key, label) in enumerate(keys):
                xs, ys = run.series(key)
                if xs:
                    ax.plot(xs, ys, RUN_STYLES[i % 2], color=f"C{j}", label=label + suffix)
    for ax, title, what in ((ax_t, "throughput", "throughput figures"), (ax_i, "idle fractions", "idle fractions")):
        if not ax.lines:
            _no_data(ax, what)
            continue
        ax.set_title(title)
        ax.set_xlabel("step")
        _integer_steps(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_i.set_ylim(0, 1.02)
    return fig


PLOT_FNS = {"reward": plot_reward, "step_time": plot_step_time, "staleness": plot_staleness,
            "buffer": plot_buffer, "throughput": plot_throughput}


def render_png(name: str, runs: list[Run]) -> bytes:
    import io

    fig = PLOT_FNS[name](runs)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_plots(runs: list[Run], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PLOTS:
        p = out_dir / f"{name}.png"
        p.write_bytes(render_png(name, runs))
        paths.append(p)
    return paths


# -- summary --------------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _fmt(v, spec: str = ".3g") -> str:
    return "—" if v is None else format(v, spec)


def run_figures(run: Run) -> dict[str, str]:
    """The summary table's rows for one run (label → formatted value)."""
    from miles.metrics.timers import breakdown

    rows: dict[str, str] = {}
    recs = run.step_records
    rows["training steps recorded"] = str(len(recs))
    total = run.config.get("loop", {}).get("num_steps")
    if total is not None and len(recs) < total:
        rows["training steps recorded"] += f" of {total} (unfinished)"
    _, acc = run.series("eval/accuracy")
    rows["eval accuracy (first → last)"] = f"{_fmt(acc[0], '.3f')} → {_fmt(acc[-1], '.3f')}" if acc else "—"
    _, rew = run.series("rollout/reward_mean")
    if rew:
        k = max(1, len(rew) // 5)
        rows["rollout reward (first → last fifth of steps)"] = f"{_fmt(_mean(rew[:k]), '.3f')} → {_fmt(_mean(rew[-k:]), '.3f')}"
    else:
        rows["rollout reward (first → last fifth of steps)"] = "—"
    step_s = [r["perf/step_s"] for r in recs]
    rows["mean step time (s)"] = _fmt(_mean(step_s))
    if recs:
        parts: dict[str, float] = {}
        for r in recs:
            for label, s in breakdown(r).items():
                parts[label] = parts.get(label, 0.0) + s
        whole = sum(parts.values()) or 1.0
        top = sorted(((s, label) for label, s in parts.items() if s > 0), reverse=True)
        rows["where step time went"] = ", ".join(f"{label} {100 * s / whole:.0f}%" for s, label in top[:6])
    for key, label in (("rollout/samples_per_s", "rollout samples/s (mean)"),
                       ("rollout/tokens_per_s", "generated tokens/s (mean)"),
                       ("perf/goodput_tokens_per_s", "goodput loss tokens/s (mean)"),
                       ("perf/engine_idle_frac", "engines idle (mean fraction)"),
                       ("perf/trainer_idle_frac", "trainer idle (mean fraction)"),
                       ("sync/total_s", "weight sync time (s, mean)")):
        rows[label] = _fmt(_mean(run.series(key)[1]))
    ledger = {label: ys[-1] for label, (_, ys) in ledger_series(run).items() if ys}
    rows["buffer ledger (groups)"] = ", ".join(f"{k} {v:.0f}" for k, v in ledger.items()) or "—"
    hist = staleness_hist(run)
    if hist:
        n = sum(hist.values())
        rows["staleness (mean / max versions)"] = f"{sum(k * v for k, v in hist.items()) / n:.2f} / {max(hist)}"
    elif run.series("buffer/staleness_max")[1]:
        rows["staleness (mean / max versions)"] = (f"{_mean(run.series('buffer/staleness_mean')[1]):.2f} / "
                                                   f"{max(run.series('buffer/staleness_max')[1]):.0f}")
    else:
        rows["staleness (mean / max versions)"] = "—"
    wall = run.summary.get("wall_time_s")
    rows["wall time"] = f"{wall:.0f}s" if isinstance(wall, (int, float)) else "—"
    return rows


def health_notes(run: Run) -> list[str]:
    """Plain warnings a person watching the curves would want pointed out."""
    notes = []
    _, acc = run.series("eval/accuracy")
    if len(acc) >= 2 and acc[-1] < acc[0]:
        notes.append(f"eval accuracy fell from {acc[0]:.3f} to {acc[-1]:.3f}")
    _, zero = run.series("rollout/zero_std_group_frac")
    if zero and _mean(zero) > 0.8:
        notes.append(f"{100 * _mean(zero):.0f}% of groups had equal rewards (no learning signal): the task may be "
                     "too easy or too hard for the model; try more samples per prompt or another temperature")
    _, trunc = run.series("rollout/truncated_frac")
    if trunc and _mean(trunc) > 0.5:
        notes.append(f"{100 * _mean(trunc):.0f}% of responses hit max_new_tokens: raise rollout.max_new_tokens")
    _, idle = run.series("perf/trainer_idle_frac")
    if idle and _mean(idle) > 0.7:
        notes.append(f"the trainer was idle {100 * _mean(idle):.0f}% of the time: generation is the bottleneck "
                     "(more engines, or an overlapped schedule)")
    ledger = {label: ys[-1] for label, (_, ys) in ledger_series(run).items() if ys}
    discarded = sum(v for k, v in ledger.items() if k.startswith("discarded_"))
    if ledger.get("drawn") and discarded > 0.5 * ledger["drawn"]:
        why = ", ".join(f"{k.removeprefix('discarded_')} {v:.0f}" for k, v in ledger.items() if k.startswith("discarded_"))
        notes.append(f"{discarded:.0f} of {ledger['drawn']:.0f} prompts drawn were discarded ({why}): see buffer.png "
                     "and the buffer settings (filter, max_staleness, on_stale)")
    total = run.config.get("loop", {}).get("num_steps")
    if total is not None and len(run.step_records) < total:
        notes.append(f"the run recorded {len(run.step_records)} of {total} steps: it is still going or stopped early")
    return notes + run.warnings


def summary_markdown(runs: list[Run], plots: list[str]) -> str:
    title = " vs ".join(r.name for r in runs)
    lines = [f"# Run report: {title}", ""]
    for r in runs:
        lines.append(f"- **{r.name}**: `{r.path}`")
    lines.append("")
    figures = [run_figures(r) for r in runs]
    lines.append("| | " + " | ".join(r.name for r in runs) + " |")
    lines.append("|---|" + "---|" * len(runs))
    for label in figures[0]:
        lines.append(f"| {label} | " + " | ".join(f.get(label, "—") for f in figures) + " |")
    lines.append("")
    for r in runs:
        notes = health_notes(r)
        if notes:
            lines.append(f"## Notes on {r.name}" if len(runs) > 1 else "## Notes")
            lines += [f"- {n}" for n in notes]
            lines.append("")
    lines.append("## Plots")
    lines.append("")
    for p in plots:
        lines.append(f"![{p}]({p}.png)")
        lines.append("")
    return "\n".join(lines)


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    runs = [load_run(d) for d in run_dirs]
    if len(runs) == 2 and runs[0].name == runs[1].name:
        for r in runs:  # same leaf name (e.g. two "grpo" runs): tell them apart by their parents
            r.name = f"{r.path.parent.name}/{r.name}"
    if out is None:
        out = runs[0].path / ("report" if len(runs) == 1 else f"report-vs-{runs[1].path.name}")
    out = Path(out)
    write_plots(runs, out)
    (out / "summary.md").write_text(summary_markdown(runs, list(PLOTS)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="miles report",
        description="Plots (PNG) and a markdown summary of a run directory; two runs side by side when "
                    "given two. Written to RUN_DIR/report/ (RUN_DIR/report-vs-OTHER/ for two runs).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `miles train` (has metrics.jsonl)")
    p.add_argument("other_run_dir", metavar="OTHER_RUN_DIR", nargs="?", help="a second run to compare with")
    p.add_argument("--out", help="where to write the PNGs and summary.md")
    p.add_argument("--serve", type=int, metavar="PORT", default=None,
                   help="instead of writing files, serve the live dashboard for RUN_DIR on this port (0 = any)")
    p.add_argument("--host", default="127.0.0.1", help="address for --serve (default: loopback)")
    args = p.parse_args(argv)
    try:
        if args.serve is not None:
            return _serve(args.run_dir, args.host, args.serve)
        dirs = [args.run_dir] + ([args.other_run_dir] if args.other_run_dir else [])
        out = write_report(dirs, args.out)
    except ReportError as e:
        print(f"miles report: {e}", file=sys.stderr)
        return 2
    for name in PLOTS:
        print(out / f"{name}.png")
    print(out / "summary.md")
    return 0


def _serve(run_dir: str, host: str, port: int) -> int:
    import time

    from miles.metrics.dashboard import Dashboard

    load_run(run_dir)  # refuse a directory that is not a run before binding a port
    dash = Dashboard(run_dir, host, port).start()
    print(f"dashboard for {run_dir}: {dash.url} (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        dash.stop()
    return 0
