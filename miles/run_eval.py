"""`miles eval CONFIG.toml --model.path DIR`: evaluation alone on any Hugging Face checkpoint.

Loads the run config as `miles train` does (the same keys and overrides), starts one built-in engine
on the checkpoint in this process (or uses rollout.engine_urls, whose engines must already serve it),
runs `eval/accuracy` and every `[[eval.sets]]` exactly as a training run's evaluation does, prints
one JSON object and optionally writes it (`--out FILE`) and appends it as a step to a metrics.jsonl
(`--metrics-dir DIR`). Non-goals: several engines, a router, training.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

from miles.engine_api.client import EngineClient
from miles.run_config import RunConfig
from miles.eval.evaluator import Evaluator
from miles.metrics.sink import JsonlSink, clean
from miles.net import LOOPBACK
from miles.rollout.generate import get_generate_fn
from miles.rewards.runner import RewardRunner
from miles.rollout.group import GroupGenerator


def run_eval(cfg: RunConfig, out: str | None = None, metrics_dir: str | None = None, step: int = 0) -> dict:
    """Evaluate cfg.model.path with cfg.eval; return the metrics (also written where asked)."""
    from miles.models.loading import load_tokenizer, load_vision  # transformers: only when an evaluation runs
    from miles.engine.server import start_server_thread

    rollout = cfg.rollout
    server = None
    urls = list(rollout.engine_urls)
    if not urls:
        engine = rollout.engine.for_run(cfg.model.path, cfg.run.seed, None)
        # No Ray node here to take an address from: an engine of this process serves on loopback.
        server = start_server_thread(engine if engine.host else dataclasses.replace(engine, host=LOOPBACK))
        urls = [server.url]
    try:
        generate_fn = None if rollout.generate_fn == "single_turn" else get_generate_fn(rollout.generate_fn)
        groups = GroupGenerator(rollout, cfg.run.seed, load_tokenizer(cfg.model.path), RewardRunner(rollout.reward, rollout.reward_config),
                                generate_fn, None, EngineClient(urls), threading.Event(),
                                vision=load_vision(cfg.model.path))
        metrics = clean(Evaluator(cfg.eval, groups, cfg.run.seed).evaluate())
    finally:
        if server is not None:
            server.stop()
    metrics = {"model": cfg.model.path, **metrics}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(metrics, indent=1) + "\n")
    if metrics_dir:
        sink = JsonlSink(Path(metrics_dir) / "metrics.jsonl")
        sink.write(step, {k: v for k, v in metrics.items() if k != "model"})
        sink.close()
    return metrics
