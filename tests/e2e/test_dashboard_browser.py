"""The live dashboard in a real headless Chromium: the page runs its script, shows the run's latest
figures, loads every plot, and picks up new steps as metrics.jsonl grows."""

import os
import re
import shutil
import subprocess
import urllib.request

import pytest

from miles.metrics.dashboard import Dashboard
from miles.metrics.plots import PLOTS
from miles.metrics.sink import JsonlSink
from miles.metrics.timers import derive
from tests.helpers.runs import new_run

pytestmark = pytest.mark.e2e


def chromium() -> str:
    path = os.environ.get("MILES_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("Chromium is needed for the dashboard browser test: run scripts/install-system.sh "
                    "(or set MILES_CHROMIUM=/path/to/chrome)")
    return path


def render_in_browser(url: str) -> str:
    """The DOM after the page's scripts ran (and its fetches and images finished)."""
    out = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-extensions", "--virtual-time-budget=6000", "--dump-dom", url],
        capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def write_step(sink: JsonlSink, k: int) -> None:
    sink.write(k, derive({
        "rollout/reward_mean": 0.1 * k, "rollout/samples_per_s": 40.0 + k, "rollout/tokens_per_s": 150.0,
        "perf/rollout_s": 2.0, "perf/reward_s": 0.1, "perf/train_s": 1.0, "perf/train_forward_s": 0.3,
        "perf/train_backward_s": 0.5, "perf/train_optimizer_s": 0.1, "perf/sync_s": 0.3, "sync/total_s": 0.25,
        "sync/transport_s": 0.1, "sync/commit_s": 0.05, "perf/step_s": 3.5, "train/loss_tokens": 400.0,
        "buffer/groups_trained": 3, "buffer/groups_discarded_zero_std": 1, "buffer/staleness/0": 4,
        **({"eval/accuracy": 0.3 + 0.05 * k} if k % 2 == 0 else {})}))


def test_dashboard_page_shows_latest_step_and_plots_and_follows_the_run(tmp_path):
    run = tmp_path / "live-run"
    sink = new_run(run, 4)
    sink.write(0, {"eval/accuracy": 0.3})
    for k in (1, 2):
        write_step(sink, k)
    dash = Dashboard(run).start()
    try:
        dom = render_in_browser(dash.url)
        status = re.search(r'<div id="status"[^>]*>([^<]*)</div>', dom)
        assert status and status.group(1) == "step 2 of 4", dom[:2000]
        assert "<td>rollout/reward_mean</td><td>0.200</td>" in dom
        assert "<td>eval/accuracy</td><td>0.400</td>" in dom
        for name in PLOTS:
            img = re.search(rf'<img data-plot="{name}"[^>]*>', dom)
            assert img and 'data-loaded="yes"' in img.group(0), f"plot {name} did not load: {img and img.group(0)}"

        # The run goes on: the page shows the new step and redraws the plots from the grown file.
        before = urllib.request.urlopen(dash.url + "plots/reward.png").read()
        for k in (3, 4):
            write_step(sink, k)
        dom = render_in_browser(dash.url)
        assert re.search(r'<div id="status"[^>]*>step 4 of 4 \(finished\)</div>', dom), dom[:2000]
        after = urllib.request.urlopen(dash.url + "plots/reward.png").read()
        assert after.startswith(b"\x89PNG") and after != before
    finally:
        dash.stop()
        sink.close()

