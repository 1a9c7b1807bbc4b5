"""Progress: a live redrawn line on a terminal, plain lines in logs and CI."""

import io
import re
import time

from miles.metrics.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_when_not_a_terminal(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    out = io.StringIO()
    p = Progress("train", 4, stream=out)
    assert not p.live
    p.phase("rollout")  # phases are not printed in logs: only finished steps are
    p.update(1, reward=0.123456, **{"samples/s": 51.0})
    p.update(2, reward=0.5)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[train] 1/4 reward=0.123 samples/s=51 |")
    assert "left" in lines[0] and "\r" not in out.getvalue()


def test_live_line_redraws_in_place_and_shows_the_running_phase(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    out = Terminal()
    p = Progress("train", 10, stream=out)
    assert p.live
    p.update(3, reward=0.5)
    p.phase("sync")
    time.sleep(2.5 * Progress.REDRAW_S)  # the ticker redraws while the driver is blocked
    text = out.getvalue()
    p.close()
    frames = [f for f in text.split("\r\x1b[2K") if f]
    assert len(frames) >= 3
    assert "█" in frames[-1] and "3/10" in frames[-1] and "reward=0.5" in frames[-1]
    assert "| sync " in frames[-1]
    assert "\n" not in text  # nothing scrolls until the work is done
    assert out.getvalue().endswith("\n")


def test_ci_gets_plain_lines_even_on_a_terminal(monkeypatch):
    monkeypatch.setenv("CI", "true")
    out = Terminal()
    p = Progress("sft", 2, stream=out)
    assert not p.live
    p.update(1, nll=1.5)
    assert out.getvalue() == out.getvalue().splitlines()[0] + "\n"
    off = Progress("sft", 2, stream=out, mode="off")
    off.update(2, nll=1.0)
    assert out.getvalue().count("\n") == 1


def test_time_left_follows_the_pace_after_start_up(monkeypatch):
    import miles.metrics.progress as progress

    clock = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    monkeypatch.delenv("CI", raising=False)
    out = io.StringIO()
    p = Progress("train", 10, stream=out)
    clock[0] = 160.0  # a minute of start-up before the first step lands
    p.update(1)
    clock[0] = 170.0  # then 10 s per step
    p.update(2)
    assert out.getvalue().splitlines()[-1].endswith("| 1m10s elapsed, ~1m20s left")


def test_live_rollout_shows_samples_so_far_and_their_rate(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(Progress, "POLL_S", 0.1)
    calls = []

    def poll():
        calls.append(1)
        return {"samples": 12.0 * len(calls)}

    out = Terminal()
    p = Progress("train", 5, stream=out)
    p.phase("rollout", poll=poll)
    time.sleep(0.8)
    p.update(1, reward=0.5)
    time.sleep(0.1)  # a poll the ticker had started before the update returns meanwhile
    n_calls = len(calls)
    time.sleep(0.4)  # the phase is over: no more polling
    p.close()
    assert n_calls >= 2 and len(calls) == n_calls
    frames = [f for f in out.getvalue().split("\r\x1b[2K") if "| rollout" in f]
    assert re.search(r"\| rollout \d+\.\ds \d+ samples \([\d.]+/s\)", frames[-1]), frames[-1]


def test_a_failing_poll_never_breaks_the_progress_line_and_plain_mode_never_polls(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(Progress, "POLL_S", 0.05)

    def broken():
        raise ConnectionError("manager gone")

    out = Terminal()
    p = Progress("train", 2, stream=out)
    p.phase("rollout", poll=broken)
    time.sleep(0.5)
    p.update(1)
    p.close()
    assert "1/2" in out.getvalue()

    calls = []
    plain = Progress("train", 2, stream=io.StringIO(), mode="plain")
    plain.phase("rollout", poll=lambda: calls.append(1) or {"samples": 1.0})
    time.sleep(0.3)
    plain.update(1)
    assert calls == []
