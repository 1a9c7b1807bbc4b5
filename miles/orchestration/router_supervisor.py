"""The run's router in a process of its own that outlives the driver, restarted on its port when it dies
and adopted by the next driver of the same run.

    SupervisedRouter ── starts `python -m miles.rollout.router` in a session of its own ──► serving at url
        │ RUN_DIR/router.json: url, pid, host, admin token, log (mode 0600, the token is in it)
        watch thread: every check_every_s, has the process exited?
            yes ─► start it again on the same port, with the engines the fleet serves now
    driver SIGKILLed (or its process group) ─► the router keeps serving /health, /list_workers, and any
        engine that outlived the driver; with none left it exits after router.exit_without_engines_s
    `miles train --resume RUN_DIR` ─► SupervisedRouter.adopt: router.json's router answers /list_workers
        and takes the admin token ─► the engines it lists that are not the new run's are removed, the
        new run's are added ─► supervised as before; none answers ─► a new one is started

Everything that talks to the router (the rollout manager, evaluation, the fleet's add/remove calls)
keeps its URL: a restart is seen as a short outage. Requests in flight through the dead router fail;
their groups go back to the buffer as engine failures and are retried after the router answers
again (group.py waits for it), so no prompt is lost. The router's state (which engines, their
quarantine) is rebuilt from the fleet: engines given at start are trusted until a check fails.
The router is stopped, and router.json removed, when the run ends (normally or by an exception);
only a driver that cannot run its cleanup (SIGKILL, SIGTERM) leaves it serving.
Chosen with `router.own_process = true` (the default); otherwise the router is a thread of the driver
and shares its fate.
Non-goals: the Rust sglang-router; a router on another host (a resumed driver on another machine
starts a new one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from miles import owners
from miles.engine_api import routes
from miles.engine_api.client import EngineClient
from miles.engine_api.errors import EngineError
from miles.net import PARENT_PID_ENV, wait_until_answers
from miles.rollout.liveness import HealthConfig
from miles.rollout.router import RouterConfig

log = logging.getLogger(__name__)

RECORD = "router.json"
_URL_LINE = re.compile(r"miles router serving .* at (http://\S+)")


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


@dataclass
class RouterRecord:
    """What a later process needs to find, administer and stop a run's router (RUN_DIR/router.json)."""

    url: str
    pid: int
    host: str
    """socket.gethostname() of the machine it runs on: only there is `pid` this router."""
    admin_token: str | None
    log: str
    started_at: float

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        # 0600: the admin token of the router and the run's engines is in it.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=2)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> RouterRecord | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not a zombie waiting for its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return owners.alive(pid)
    return state != "Z"


def spawn_router(config: RouterConfig, health: HealthConfig, worker_urls: list[str], port: int, log_path: Path,
                 startup_timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start `python -m miles.rollout.router` in a session of its own (a signal to the driver's process
    group does not reach it), its output appended to `log_path` (a pipe would break when the driver
    dies); returns the process and its URL once it answers. RuntimeError with its log otherwise."""
    cmd = [sys.executable, "-m", "miles.rollout.router", *router_args(config, health, port)]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    env = dict(os.environ)
    env.pop(PARENT_PID_ENV, None)  # it must not end with the driver (net.exit_with_parent)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        offset = out.tell()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + startup_timeout_s
    url = None
    while proc.poll() is None and time.monotonic() < deadline:
        with log_path.open("rb") as f:
            f.seek(offset)
            m = _URL_LINE.search(f.read().decode(errors="replace"))
        if m:
            url = m.group(1)
            if wait_until_answers(url + routes.LIST_WORKERS, deadline - time.monotonic(), lambda: proc.poll() is None):
                return proc, url
            break
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    with log_path.open("rb") as f:
        f.seek(offset)
        tail = f.read().decode(errors="replace")[-4000:]
    raise RuntimeError(f"router process did not answer {routes.LIST_WORKERS} within {startup_timeout_s}s "
                       f"(exit code {proc.returncode}, url {url}); its output ({log_path}):\n{tail}")


class SupervisedRouter:
    """The built-in router in a process of its own: `.url` stays the same across restarts; `.pid` is the
    current process; `.restarts` records each death (time.time() of its detection and of serving again);
    `.adopted` whether it was left serving by an earlier driver of the run.

    `state_dir` holds router.json and router.log (a run's directory); without one, a fresh temporary
    folder."""

    def __init__(self, config: RouterConfig, worker_urls: list[str], health: HealthConfig,
                 workers: Callable[[], list[str]] | None = None, check_every_s: float = 0.2,
                 state_dir: Path | None = None, _adopt: RouterRecord | None = None):
        self.config, self.health = config, health
        self.workers = workers or (lambda: list(worker_urls))
        self.check_every_s = check_every_s
        self.restarts: list[dict] = []
        self._own_dir = state_dir is None  # a temporary folder of this object's, removed at stop()
        if state_dir is None:
            state_dir = Path(tempfile.mkdtemp(prefix="miles-router-"))
        self.record_path = Path(state_dir) / RECORD
        self.log_path = Path(state_dir) / "router.log"
        self.adopted = _adopt is not None
        if _adopt is not None:
            self._proc: subprocess.Popen | None = None  # not this process's child: watched by pid
            self._pid, self.url = _adopt.pid, _adopt.url
            self._started_at = _adopt.started_at
        else:
            self._proc, self.url = spawn_router(config, health, worker_urls, config.port, self.log_path)
            self._pid, self._started_at = self._proc.pid, time.time()
        self._port = int(self.url.rsplit(":", 1)[1])
        self._save()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="miles-router-supervisor", daemon=True)
        self._thread.start()

    @classmethod
    def adopt(cls, state_dir: Path, config: RouterConfig, worker_urls: list[str], health: HealthConfig,
              workers: Callable[[], list[str]] | None = None, check_every_s: float = 0.2) -> SupervisedRouter | None:
        """The router an earlier driver of the run left serving (state_dir/router.json), given exactly the
        engines `worker_urls` (the ones it lists that are not among them are removed: they died with that
        driver); None when there is no such router, it does not answer, runs on another machine, or does
        not take `config.admin_token`."""
        record = RouterRecord.load(Path(state_dir) / RECORD)
        if record is None:
            return None
        if record.host != socket.gethostname():
            log.warning("the run's router %s ran on %s, not on this machine: starting a new one", record.url,
                        record.host)
            return None
        if not _running(record.pid):
            log.warning("the run's router %s (pid %d) is gone: starting a new one", record.url, record.pid)
            return None
        if record.admin_token != config.admin_token:
            log.warning("the run's router %s (pid %d) has another admin token than this run's engines: starting a "
                        "new one (stop that one by its pid)", record.url, record.pid)
            return None
        try:
            with EngineClient(admin_token=record.admin_token, timeout_s=10.0, connect_timeout_s=5.0) as client:
                listed = client.get(record.url, routes.LIST_WORKERS)["urls"]
                for url in listed:
                    if url not in worker_urls:
                        _expect_ok(client.send("POST", record.url, routes.REMOVE_WORKER, params={"url": url}), url)
                for url in worker_urls:
                    if url not in listed:
                        _expect_ok(client.send("POST", record.url, routes.ADD_WORKER, params={"url": url}), url)
        except (EngineError, KeyError, ValueError, RuntimeError) as exc:
            log.warning("the run's router %s (pid %d) did not take the new engines (%s): starting a new one",
                        record.url, record.pid, str(exc).splitlines()[0][:200])
            return None
        log.warning("adopted the run's router at %s (pid %d), left serving by an earlier driver; dropped %d "
                    "engines of that driver, registered %d", record.url, record.pid,
                    len(set(listed) - set(worker_urls)), len(set(worker_urls) - set(listed)))
        return cls(config, worker_urls, health, workers, check_every_s, state_dir, _adopt=record)

    @property
    def pid(self) -> int:
        return self._pid

    def _save(self) -> None:
        RouterRecord(self.url, self._pid, socket.gethostname(), self.config.admin_token, str(self.log_path),
                     self._started_at).save(self.record_path)

    def _exit_code(self) -> int | None | bool:
        """The exit code once the process is gone (True for an adopted one, whose code is not ours to
        read); None while it runs."""
        if self._proc is not None:
            return self._proc.poll()
        return None if _running(self._pid) else True

    def _watch(self) -> None:
        while not self._stop.wait(self.check_every_s):
            code = self._exit_code()
            if code is None:
                continue
            rec = {"pid": self._pid, "exit_code": None if code is True else code, "detected_at": time.time(),
                   "serving_at": None}
            self.restarts.append(rec)
            log.warning("the router (pid %d) exited with code %s: starting it again on %s", rec["pid"],
                        rec["exit_code"], self.url)
            while not self._stop.is_set():
                try:
                    proc, _ = spawn_router(self.config, self.health, self.workers(), self._port, self.log_path)
                except RuntimeError as exc:  # the port not yet free, say: try again shortly
                    log.warning("restarting the router failed (%s); trying again", str(exc).splitlines()[0])
                    self._stop.wait(1.0)
                    continue
                if self._stop.is_set():
                    _end(proc.pid, proc)
                    return
                self._proc, self._pid, self._started_at = proc, proc.pid, time.time()
                self._save()
                rec["serving_at"] = time.time()
                log.warning("the router serves again at %s, %.1fs after its death was seen", self.url,
                            rec["serving_at"] - rec["detected_at"])
                break

    def report(self) -> dict:
        back = [r["serving_at"] - r["detected_at"] for r in self.restarts if r["serving_at"]]
        return {"restarts": len(self.restarts), "max_restart_s": max(back) if back else None,
                "adopted": self.adopted}

    def stop(self) -> None:
        """End the router for good (the run is over): no restart, the process ended, router.json removed."""
        self._stop.set()
        self._thread.join(timeout=120)
        _end(self._pid, self._proc)
        try:
            self.record_path.unlink()
        except FileNotFoundError:
            pass
        if self._own_dir:
            shutil.rmtree(self.record_path.parent, ignore_errors=True)


def _expect_ok(resp, url: str) -> None:
    if resp.status_code != 200:
        raise RuntimeError(f"{url}: answered {resp.status_code}: {resp.text[:200]}")


def _end(pid: int, proc: subprocess.Popen | None, timeout_s: float = 15.0) -> None:
    """SIGTERM (uvicorn finishes its requests), then SIGKILL after timeout_s; a child is also reaped."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (proc.poll() is not None) if proc is not None else not _running(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc is not None:
        proc.wait()
