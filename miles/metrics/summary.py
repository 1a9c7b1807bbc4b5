"""The report's words: a markdown table of a run's headline figures and plain notes on its health.

One column per run, so two runs read side by side; the notes point out what a person watching the
curves would want said (falling accuracy, groups without signal, truncation, an idle trainer, heavy
discards, an unfinished run). Non-goals: plots (plots.py) and reading the files (run_data.py).
"""

from __future__ import annotations

from miles.metrics.run_data import Run, ledger_series, staleness_hist
from miles.metrics.timers import breakdown


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _fmt(v, spec: str = ".3g") -> str:
    return "—" if v is None else format(v, spec)


def run_figures(run: Run) -> dict[str, str]:
    """The summary table's rows for one run (label → formatted value)."""
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
    """summary.md: a figures table (one column per run), health notes, then the plots by file name."""
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
