"""Run a built-in engine as a child process (`python -m miles.engine.server`) and find its URL.

Used by tests and by anything that wants an engine isolated in its own process (its own torch
threads, its own crash domain) without Ray.
Non-goal: supervision or restarts; the router's health checks and the orchestrator own those.
"""

from __future__ import annotations

import sys

from miles.net import LOOPBACK, ServerProcess


class EngineProcess(ServerProcess):
    """Start with `EngineProcess(model_dir, admin_token=...)`; use `.url`; `.stop()` (or `with`)."""

    def __init__(self, model_path: str, *, host: str = LOOPBACK, port: int = 0, admin_token: str | None = None,
                 extra_args: list[str] | None = None, startup_timeout_s: float = 120.0, env: dict | None = None):
        cmd = [sys.executable, "-m", "miles.engine.server", "--model", str(model_path), "--host", host,
               "--port", str(port)]
        if admin_token is not None:
            cmd += ["--admin-token", admin_token]
        cmd += extra_args or []
        super().__init__(cmd, url_line=r"miles engine serving .* at (http://\S+)", ready_path="/health",
                         startup_timeout_s=startup_timeout_s, what="engine process", env=env)
