"""The Rust sglang-router as an alternative to the built-in one (`router.kind = "sglang"`).

It does not forward fields it does not know, so `RouterConfig.check_features` refuses it where a
feature needs one (routed experts). Non-goal: installing it (`pip install sglang-router`).
"""

from __future__ import annotations

import subprocess
import sys

from miles.rollout.liveness import HealthConfig
from miles.rollout.router.config import RouterConfig


def launch_sglang_router(config: RouterConfig, worker_urls: list[str], port: int,
                         extra_args: list[str] | None = None, health: HealthConfig | None = None) -> subprocess.Popen:
    """Start the Rust sglang-router (a test dependency, `pip install sglang-router`) on `port`."""
    health = health or HealthConfig()
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise RuntimeError("router.kind = 'sglang' needs the sglang-router package: pip install sglang-router, "
                           "or set router.kind = 'miles'") from None
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", config.host, "--port", str(port),
           "--policy", "power_of_two" if len(worker_urls) > 1 else "round_robin",
           "--health-failure-threshold", str(health.failure_threshold),
           "--health-check-interval-secs", str(max(1, int(health.interval_s))),
           "--request-timeout-secs", str(int(config.request_timeout_s)),
           "--worker-urls", *worker_urls, *(extra_args or [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
