"""`miles report RUN_DIR [OTHER_RUN_DIR]`: plots and a markdown summary of finished (or running) runs.

Writes PNGs and summary.md to RUN_DIR/report/ (or RUN_DIR/report-vs-OTHER/ for two runs; --out to
choose), or with --serve PORT serves the live dashboard for RUN_DIR instead. This module is only the
command: reading a run is run_data.py, the pictures plots.py, the table and notes summary.py, the
live page dashboard.py. Non-goal: interactive plots.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from miles.metrics.dashboard import Dashboard
from miles.metrics.plots import PLOTS, write_plots
from miles.metrics.run_data import ReportError, load_run
from miles.metrics.summary import summary_markdown
from miles.net import LOOPBACK


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Plots and summary.md for one run or two side by side; returns the directory written."""
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
    """`miles report`; exit status 2 (with the reason on stderr) when a directory is not a run."""
    p = argparse.ArgumentParser(
        prog="miles report",
        description="Plots (PNG) and a markdown summary of a run directory; two runs side by side when "
                    "given two. Written to RUN_DIR/report/ (RUN_DIR/report-vs-OTHER/ for two runs).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `miles train` (has metrics.jsonl)")
    p.add_argument("other_run_dir", metavar="OTHER_RUN_DIR", nargs="?", help="a second run to compare with")
    p.add_argument("--out", help="where to write the PNGs and summary.md")
    p.add_argument("--serve", type=int, metavar="PORT", default=None,
                   help="instead of writing files, serve the live dashboard for RUN_DIR on this port (0 = any)")
    p.add_argument("--host", default=LOOPBACK, help="address for --serve (default: loopback)")
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
    load_run(run_dir)  # refuse a directory that is not a run before binding a port
    dash = Dashboard(run_dir, host, port).start()
    print(f"dashboard for {run_dir}: {dash.url} (Ctrl-C to stop)", flush=True)
    try:
        while True:  # short sleeps: Ctrl-C caught by a server thread is handled once the main thread wakes
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        dash.stop()
    return 0
