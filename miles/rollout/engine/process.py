"""Run a built-in engine as a child process (`python -m miles.rollout.engine.server`) and find its URL.

Used by tests and by anything that wants an engine isolated in its own process (its own torch
threads, its own crash domain) without Ray.
Non-goal: supervision or restarts; the router's health checks and the orchestrator own those.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

_URL_LINE = re.compile(r"miles engine serving .* at (http://\S+)")


class EngineProcess:
    """Start with `EngineProcess(model_dir, admin_token=...)`; use `.url`; `.stop()` (or `with`)."""

    def __init__(self, model_path: str, *, host: str = "127.0.0.1", port: int = 0, admin_token: str | None = None,
                 extra_args: list[str] | None = None, startup_timeout_s: float = 120.0, env: dict | None = None):
        cmd = [sys.executable, "-m", "miles.rollout.engine.server", "--model", str(model_path), "--host", host,
               "--port", str(port)]
        if admin_token is not None:
            cmd += ["--admin-token", admin_token]
        cmd += extra_args or []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.output: list[str] = []  # everything the child printed, for error messages
        self._url_found = threading.Event()
        self.url: str | None = None
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_ready(startup_timeout_s)

    def _drain(self) -> None:
        # Always read the pipe, or a chatty child would block on a full pipe buffer.
        for line in self.proc.stdout:
            self.output.append(line)
            m = _URL_LINE.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._url_found.set()

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._url_found.wait(0.1):
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
        self.stop()
        raise RuntimeError(f"engine process did not become healthy within {timeout_s}s "
                           f"(exit code {self.proc.returncode}); its output:\n{''.join(self.output[-50:])}")

    def stop(self, timeout_s: float = 15.0) -> None:
        terminate(self.proc, timeout_s)

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def terminate(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if the child has not exited within timeout_s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
