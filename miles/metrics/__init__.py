"""Metrics: step records with namespaced keys, their sinks, step timers and progress lines, and
reading a run back: run_data (the run directory) feeds plots and summary, which the `miles report`
command (report.py) writes and the live dashboard (dashboard.py) serves."""
