"""The report's pictures: one PNG per view of a run (reward, step time, staleness, buffer, throughput).

Each plot takes one run, or two drawn side by side with the same colours and scales so they compare
at a glance. `miles report` writes them to files; the live dashboard serves the same bytes.
matplotlib is imported only when a plot is drawn (`miles report --help` must not pay for it), and
through `Figure`, never pyplot, so the dashboard's server threads can draw without global state.
Non-goal: interactive plots.
"""

from __future__ import annotations

import io
from pathlib import Path

from miles.metrics.run_data import Run, ledger_series, staleness_hist
from miles.metrics.timers import breakdown

# One colour per step-time part, fixed so two reports (and two runs) read the same way.
PART_COLORS = {
    "rollout": "#4C72B0", "wait for data": "#4C72B0", "reward": "#64B5CD",
    "train forward": "#DD8452", "train backward": "#C44E52", "train optimizer": "#8C564B", "train other": "#E7A98B",
    "sync prepare": "#55A868", "sync transport": "#2CA02C", "sync apply": "#98DF8A", "sync verify": "#BCBD22",
    "sync other": "#CFE8C0", "eval": "#8172B3", "other": "#BBBBBB",
}
RUN_STYLES = ("-", "--")


def _figure(ncols: int = 1, width: float = 7.0, height: float = 4.0):
    from matplotlib.figure import Figure

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


def _finish_step_axis(ax, title: str, what: str, *, ylabel: str | None = None, legend: dict | None = None) -> None:
    """Dress an axis plotted against the step: title, whole-number steps, a light grid, and a legend
    when `legend` (its keyword arguments) is given; an axis with nothing drawn says "no <what>" instead."""
    if not ax.lines:
        _no_data(ax, what)
        return
    ax.set_title(title)
    ax.set_xlabel("step")
    _integer_steps(ax)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend is not None:
        ax.legend(**legend)


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
    legend = {} if len(runs) > 1 else None
    _finish_step_axis(ax_r, "rollout reward (mean)", "rollout reward", legend=legend)
    _finish_step_axis(ax_e, "eval accuracy", "eval", legend=legend)
    return fig


def plot_step_time(runs: list[Run]):
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


def plot_buffer(runs: list[Run]):
    fig, (ax,) = _figure(1, 7.0)
    colors: dict[str, str] = {}
    palette = ["#333333", "#55A868", "#8172B3", "#C44E52", "#DD8452", "#4C72B0", "#DA8BC3", "#937860", "#8C8C8C"]
    for i, run in enumerate(runs):
        for label, (xs, ys) in ledger_series(run).items():
            color = colors.setdefault(label, palette[len(colors) % len(palette)])
            ax.plot(xs, ys, RUN_STYLES[i % 2], color=color, label=label + (f" ({run.name})" if len(runs) > 1 else ""))
    _finish_step_axis(ax, "buffer ledger (prompts/groups so far)", "buffer ledger counters", ylabel="groups",
                      legend={"fontsize": 8, "loc": "upper left", "bbox_to_anchor": (1.0, 1.0)})
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
    _finish_step_axis(ax_t, "throughput", "throughput figures", legend={"fontsize": 8})
    _finish_step_axis(ax_i, "idle fractions", "idle fractions", legend={"fontsize": 8})
    ax_i.set_ylim(0, 1.02)
    return fig


PLOT_FNS = {"reward": plot_reward, "step_time": plot_step_time, "staleness": plot_staleness,
            "buffer": plot_buffer, "throughput": plot_throughput}
PLOTS = tuple(PLOT_FNS)
"""Plot names in the order the report and the dashboard show them (each is also its PNG's file stem)."""


def render_png(name: str, runs: list[Run]) -> bytes:
    """One of PLOTS drawn for `runs` (one run, or two side by side), as PNG bytes."""
    fig = PLOT_FNS[name](runs)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_plots(runs: list[Run], out_dir: Path) -> list[Path]:
    """Every plot as out_dir/<name>.png, in PLOTS order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PLOTS:
        p = out_dir / f"{name}.png"
        p.write_bytes(render_png(name, runs))
        paths.append(p)
    return paths
