"""The dashboard server outside the browser: serving a finished run from `miles report --serve`,
refusing a busy port with the fix, answering unknown paths with a hint."""

import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from miles.metrics.dashboard import Dashboard
from miles.metrics.report import main
from tests.helpers.runs import new_run


@pytest.fixture()
def run_dir(tmp_path):
    run = tmp_path / "finished"
    sink = new_run(run, 1)
    sink.write(0, {"eval/accuracy": 0.25})
    sink.write(1, {"rollout/reward_mean": 0.5, "perf/step_s": 2.0, "eval/accuracy": 0.5})
    sink.close()
    return run


def test_report_serve_shows_a_finished_run_until_interrupted(run_dir):
    # As from a terminal, where Ctrl-C reaches the process: a shell's background job (CI scripts
    # started with `&`) inherits SIGINT ignored, and so would this child.
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "report", str(run_dir), "--serve", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        assert "dashboard for" in line, line + proc.stderr.read()
        url = line.split(": ", 1)[1].split(" ")[0]
        status = json.loads(urllib.request.urlopen(url + "api/status", timeout=10).read())
        assert status == {"run": "finished", "step": 1, "total_steps": 1, "version": status["version"],
                          "latest": {"step": 1, "eval/accuracy": 0.5, "rollout/reward_mean": 0.5, "perf/step_s": 2.0}}
        assert b"miles run <code>finished</code>" in urllib.request.urlopen(url, timeout=10).read()
        proc.send_signal(signal.SIGINT)
        # communicate, not wait: a child blocked writing to a full stderr pipe would never exit.
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_busy_port_is_refused_with_the_fix(run_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match="choose another metrics.dashboard_port or 0"):
            Dashboard(run_dir, port=port).start()


def test_unknown_paths_get_a_hint_and_bad_run_dirs_are_refused(run_dir, tmp_path, capsys):
    dash = Dashboard(run_dir).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(dash.url + "plots/nope.png", timeout=10)
        assert e.value.code == 404 and b"/api/status" in e.value.read()
    finally:
        dash.stop()
    assert main([str(tmp_path / "not-a-run"), "--serve", "0"]) == 2
    assert "is not a directory" in capsys.readouterr().err
