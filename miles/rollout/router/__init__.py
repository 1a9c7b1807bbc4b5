"""Router: one URL in front of many engines, speaking the same SGLang HTTP API they do.

    config.py    RouterConfig: which router, where it listens, stickiness, retries
    policy.py    Router: engine selection, quarantine and re-admission, proxying
    app.py       the HTTP app, served on a thread, in a child process or as `miles router`
    launcher.py  the Rust sglang-router instead (`router.kind = "sglang"`)

When an engine counts as dead is the shared liveness section (miles/rollout/liveness.py); the HTTP client
to the engines is miles' one EngineClient (miles/engine_api/client.py).
"""

from miles.rollout.router.app import (RouterProcess, RouterServeConfig, RunningRouter, build_app, main,
                                      parse_args, start_router_thread)
from miles.rollout.router.config import ROUTER_KINDS, RouterConfig
from miles.rollout.router.launcher import launch_sglang_router
from miles.rollout.router.policy import Router, Worker

__all__ = ["ROUTER_KINDS", "Router", "RouterConfig", "RouterProcess", "RouterServeConfig", "RunningRouter", "Worker",
           "build_app", "launch_sglang_router", "main", "parse_args", "start_router_thread"]
