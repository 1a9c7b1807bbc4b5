"""A real short RL run with every observability piece on: the driver serves the live dashboard while
it trains, mirrors metrics to TensorBoard and offline W&B, records the per-step timing breakdown,
and `miles report` turns the finished run directory into plots and a summary."""

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_with_dashboard_sinks_and_report(tiny_model_dir, tmp_path, ray_cluster):
    from miles.config import load_config
    from miles.config.run import RunConfig
    from miles.orchestration.driver import run_train

    port = _free_port()
    cfg = load_config(RunConfig, None, {
        "model.path": tiny_model_dir, "run.output_dir": str(tmp_path), "run.name": "observed",
        "loop.num_steps": "3", "eval.every_steps": "2", "eval.num_prompts": "8", "eval.max_new_tokens": "4",
        "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "4",
        "trainer.lr": "1e-3", "metrics.tensorboard": "true", "metrics.wandb": "offline",
        "metrics.dashboard": "true", "metrics.dashboard_port": str(port), "metrics.progress": "plain"})

    seen: dict = {}
    stop = threading.Event()

    def watch():  # what a person with the dashboard open sees while the run goes on
        url = f"http://127.0.0.1:{port}/"
        while not stop.is_set():
            try:
                status = json.loads(urllib.request.urlopen(url + "api/status", timeout=5).read())
                if status["step"] >= 1 and "png" not in seen:
                    seen["status"] = status
                    seen["page"] = urllib.request.urlopen(url, timeout=5).read().decode()
                    seen["png"] = urllib.request.urlopen(url + "plots/step_time.png", timeout=30).read()
            except OSError:
                pass
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        summary = run_train(cfg)
    finally:
        stop.set()
        watcher.join(timeout=10)
    run_dir = tmp_path / "observed"
    assert summary["run_dir"] == str(run_dir)

    assert seen.get("status", {}).get("total_steps") == 3, "the live dashboard never showed a finished step"
    assert seen["status"]["latest"]["rollout/reward_mean"] is not None
    assert 'data-plot="step_time"' in seen["page"]
    assert seen["png"].startswith(b"\x89PNG")
    with pytest.raises(OSError):  # and it is gone with the run
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 3
    for r in steps:
        for key in ("perf/rollout_s", "perf/reward_s", "perf/train_s", "perf/sync_s", "perf/wait_data_s",
                    "sync/prepare_s", "sync/transport_s", "sync/apply_s", "perf/goodput_tokens_per_s",
                    "perf/engine_idle_frac", "perf/trainer_idle_frac", "buffer/staleness/0"):
            assert key in r, key
        assert 0.0 <= r["perf/trainer_idle_frac"] <= 1.0
        parts = r["perf/rollout_s"] + r["perf/train_s"] + r["perf/sync_s"] + r.get("perf/eval_s", 0.0)
        assert parts <= r["perf/step_s"] + 1e-6
    if any(r.get("train/loss_tokens") for r in steps):
        trained = next(r for r in steps if r.get("train/loss_tokens"))
        assert trained["perf/goodput_tokens_per_s"] > 0
        assert "perf/train_forward_s" in trained and "perf/train_backward_s" in trained

    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))

    out = subprocess.run([sys.executable, "-m", "miles.cli", "report", str(run_dir)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary_md = (run_dir / "report" / "summary.md").read_text()
    assert "| training steps recorded | 3 |" in summary_md
    assert f"{summary['eval_accuracy_after']:.3f}" in summary_md.split("eval accuracy (first → last) |")[1]
    for name in ("reward", "step_time", "staleness", "buffer", "throughput"):
        assert (run_dir / "report" / f"{name}.png").stat().st_size > 5000
