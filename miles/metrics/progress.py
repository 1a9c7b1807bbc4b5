"""Progress display for long work (SFT, RL steps, rollout collection, weight sync).

On a terminal it is one live line, redrawn a few times a second: a bar, the latest figures, what
is happening right now ("rollout 3.2s", "sync 0.4s") and the time left. In logs and CI (not a
terminal, `CI` set, or `TERM=dumb`) it prints one plain line per update instead, since carriage
returns and redraws turn a log file into noise. Non-goal: nested bars; one line per piece of work.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def _is_live(stream, mode: str) -> bool:
    if mode in ("live", "plain", "off"):
        return mode == "live"
    if os.environ.get("CI") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _fmt_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _fmt_duration(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


class Progress:
    """Usage: `p.phase("rollout")` while a step's parts run, `p.update(done, reward=...)` after it,
    `p.close()` at the end. `mode`: auto | live | plain | off (metrics.progress)."""

    REDRAW_S = 0.25
    POLL_S = 1.0
    BAR = 20

    def __init__(self, label: str, total: int, stream=None, mode: str = "auto"):
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.mode = mode
        self.live = _is_live(self.stream, mode)
        self.t0 = time.perf_counter()
        self.done = 0
        self._first: tuple[float, int] | None = None  # (time, done) at the first update
        self.fields: dict[str, float | str] = {}
        self._phase: str | None = None
        self._phase_t0 = 0.0
        self._poll = None
        self._polled: dict[str, float] = {}
        self._polled_at = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.live:
            # The driver blocks in ray.get for seconds at a time; a ticker keeps the clock moving.
            self._ticker = threading.Thread(target=self._tick, name=f"progress-{label}", daemon=True)
            self._ticker.start()

    # -- what callers use ---------------------------------------------------------------------
    def phase(self, name: str | None, poll=None) -> None:
        """Name what is running now (shown with its elapsed time on a terminal).

        `poll`, if given, returns figures of the work in progress ({"samples": n, ...}); on a terminal
        it is called about once a second and `samples` is shown with its rate since the phase began.
        It is never called in plain mode, so logs and CI pay nothing for it.
        """
        with self._lock:
            self._phase, self._phase_t0 = name, time.perf_counter()
            self._poll, self._polled, self._polled_at = poll, {}, 0.0
            if self.live:
                self._draw()

    def update(self, done: int, **fields: float | str) -> None:
        """`done` of `total` finished; `fields` are the figures worth seeing (reward, samples/s, ...)."""
        with self._lock:
            if self._first is None:
                self._first = (time.perf_counter(), done)
            self.done, self.fields = done, fields
            self._phase, self._poll, self._polled = None, None, {}
            if self.mode == "off":
                return
            if self.live:
                self._draw()
            else:
                self.stream.write(self._plain_line() + "\n")
                self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=1.0)
            self._ticker = None
            with self._lock:
                self._phase = None
                self._draw()
                self.stream.write("\n")  # leave the final state on screen
                self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- rendering ----------------------------------------------------------------------------
    def _timing(self) -> tuple[float, float]:
        now = time.perf_counter()
        elapsed = now - self.t0
        if self._first is not None and self.done > self._first[1]:
            # The rate since the first update: start-up (Ray, model loading) says nothing about the rest.
            per_item = (now - self._first[0]) / (self.done - self._first[1])
        elif self.done:
            per_item = elapsed / self.done
        else:
            return elapsed, float("nan")
        return elapsed, per_item * (self.total - self.done)

    def _figures(self) -> str:
        return " ".join(f"{k}={_fmt_value(v)}" for k, v in self.fields.items())

    def _plain_line(self) -> str:
        elapsed, left = self._timing()
        eta = f", ~{_fmt_duration(left)} left" if left == left else ""
        figures = f" {self._figures()}" if self.fields else ""
        return f"[{self.label}] {self.done}/{self.total}{figures} | {_fmt_duration(elapsed)} elapsed{eta}"

    def _live_line(self) -> str:
        elapsed, left = self._timing()
        filled = int(self.BAR * self.done / self.total) if self.total else self.BAR
        bar = "█" * filled + "░" * (self.BAR - filled)
        now = ""
        if self._phase:
            running = time.perf_counter() - self._phase_t0
            now = f" | {self._phase} {running:.1f}s"
            if "samples" in self._polled:
                n = self._polled["samples"]
                now += f" {n:.0f} samples ({n / max(running, 1e-9):.3g}/s)"
        eta = f" ~{_fmt_duration(left)} left" if left == left else ""
        figures = f" {self._figures()}" if self.fields else ""
        return f"[{self.label}] {bar} {self.done}/{self.total}{figures}{now} | {_fmt_duration(elapsed)}{eta}"

    def _draw(self) -> None:
        # \r + erase-line redraws in place; the line is cut to the terminal width so it never wraps.
        width = _terminal_width(self.stream)
        self.stream.write("\r\x1b[2K" + self._live_line()[: width - 1])
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(self.REDRAW_S):
            poll = self._poll
            if poll is not None and time.perf_counter() - self._polled_at >= self.POLL_S:
                self._polled_at = time.perf_counter()
                try:
                    polled = dict(poll())
                except Exception:  # noqa: BLE001 - a progress line must never take the run down
                    polled = None
                with self._lock:
                    if self._poll is poll:  # the phase may have ended while we asked
                        if polled is None:
                            self._poll = None
                        else:
                            self._polled = polled
            with self._lock:
                self._draw()


def _terminal_width(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 120
