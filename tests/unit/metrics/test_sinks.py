"""Step records reach metrics.jsonl always, and TensorBoard / W&B (offline) when configured."""

import json
import time

import pytest

from miles.metrics.sink import JsonlSink, MetricsConfig, MetricsFileError, open_sinks, read_metrics


def test_jsonl_keeps_every_step_and_turns_nan_into_null(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write(0, {"eval/accuracy": 0.25})
    sink.write(1, {"rollout/reward_mean": 0.5, "train/loss": float("nan"), "buffer/groups_trained": 3})
    # Appended and flushed per step: a reader sees the steps before the sink is closed.
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[1])
    assert rec == {"step": 1, "buffer/groups_trained": 3.0, "rollout/reward_mean": 0.5, "train/loss": None}


def test_a_torn_last_line_is_skipped_with_a_warning_but_damage_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "eval/accuracy": 0.1}\n{"step": 1, "rollout/rew')
    warnings = []
    assert [r["step"] for r in read_metrics(path, warn=warnings.append)] == [0]
    assert "torn last line" in warnings[0]
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(MetricsFileError, match=":2 is not valid JSON"):
        read_metrics(path)
    with pytest.raises(MetricsFileError, match="miles train"):
        read_metrics(tmp_path / "missing.jsonl")


def test_tensorboard_and_wandb_offline_mirror_the_records(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = MetricsConfig(tensorboard=True, wandb="offline")
    sinks = open_sinks(cfg, tmp_path, "unit", {"loop": {"num_steps": 3}})
    for step in range(3):
        sinks.write(step, {"rollout/reward_mean": 0.1 * step, "eval/accuracy": 0.5, "note": "text is skipped"})
    sinks.close()

    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "rollout/reward_mean" in acc.Tags()["scalars"]
    events = acc.Scalars("rollout/reward_mean")
    assert [e.step for e in events] == [0, 1, 2]
    assert events[2].value == pytest.approx(0.2)

    # Offline W&B: a run directory under RUN_DIR/wandb that `wandb sync` can upload later.
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # The wandb service writes the file from its own process and may finish a moment after finish().
    deadline = time.monotonic() + 30
    while runs[0].read_bytes().count(b"rollout/reward_mean") < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runs[0].read_bytes().count(b"rollout/reward_mean") >= 3


def test_config_names_the_fix_for_a_missing_integration(monkeypatch):
    import importlib.util

    from miles.config import ConfigError, load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'miles\[wandb\]'"):
        MetricsConfig(wandb="offline").validate()
    with pytest.raises(ConfigError, match="'off', 'offline', 'online'"):
        load_config(MetricsConfig, None, {"wandb": "cloud"})
