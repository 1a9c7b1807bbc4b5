"""The run's router in a process of its own, restarted on the same port when it dies.

    SupervisedRouter ── starts `python -m miles.rollout.router` (RouterProcess) ──► serving at url
        watch thread: every check_every_s, has the process exited?
            yes ─► start it again on the same port, with the engines the fleet serves now

Everything that talks to the router (the rollout manager, evaluation, the fleet's add/remove calls)
keeps its URL: a restart is seen as a short outage. Requests in flight through the dead router fail;
their groups go back to the buffer as engine failures and are retried after the router answers
again (group.py waits for it), so no prompt is lost. The router's state (which engines, their
quarantine) is rebuilt from the fleet: engines given at start are trusted until a check fails.
Chosen with `router.own_process = true`; otherwise the router is a thread of the driver and shares
its fate (a killed driver is resumed with `miles train --resume`).
Non-goals: the Rust sglang-router; a router on another host.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from miles.rollout.liveness import HealthConfig
from miles.rollout.router import RouterConfig, RouterProcess

log = logging.getLogger(__name__)


def router_args(config: RouterConfig, health: HealthConfig, port: int) -> list[str]:
    """`miles router` flags that serve `config` and `health` on `port`."""
    args = ["--port", str(port)]
    for section, cfg in (("router", config), ("health", health)):
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if value is None or (section == "router" and f.name in ("port", "own_process")):
                continue
            args += [f"--{section}.{f.name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


class SupervisedRouter:
    """The built-in router in a child process: `.url` stays the same across restarts; `.pid` is the
    current process; `.restarts` records each death (time.time() of its detection and of serving again)."""

    def __init__(self, config: RouterConfig, worker_urls: list[str], health: HealthConfig,
                 workers: Callable[[], list[str]] | None = None, check_every_s: float = 0.2):
        self.config, self.health = config, health
        self.workers = workers or (lambda: list(worker_urls))
        self.check_every_s = check_every_s
        self.restarts: list[dict] = []
        self._proc = RouterProcess(worker_urls, extra_args=router_args(config, health, config.port))
        self.url = self._proc.url
        self._port = int(self.url.rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="miles-router-supervisor", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int:
        return self._proc.proc.pid

    def _watch(self) -> None:
        while not self._stop.wait(self.check_every_s):
            code = self._proc.proc.poll()
            if code is None:
                continue
            rec = {"pid": self._proc.proc.pid, "exit_code": code, "detected_at": time.time(), "serving_at": None}
            self.restarts.append(rec)
            log.warning("the router (pid %d) exited with code %s: starting it again on %s", rec["pid"], code,
                        self.url)
            while not self._stop.is_set():
                try:
                    proc = RouterProcess(self.workers(), extra_args=router_args(self.config, self.health, self._port))
                except RuntimeError as exc:  # the port not yet free, say: try again shortly
                    log.warning("restarting the router failed (%s); trying again", str(exc).splitlines()[0])
                    self._stop.wait(1.0)
                    continue
                if self._stop.is_set():
                    proc.stop()
                    return
                self._proc = proc
                rec["serving_at"] = time.time()
                log.warning("the router serves again at %s, %.1fs after its death was seen", self.url,
                            rec["serving_at"] - rec["detected_at"])
                break

    def report(self) -> dict:
        back = [r["serving_at"] - r["detected_at"] for r in self.restarts if r["serving_at"]]
        return {"restarts": len(self.restarts), "max_restart_s": max(back) if back else None}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        self._proc.stop()
