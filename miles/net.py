"""Network plumbing every miles server and client shares: listening sockets, free ports, the one
bearer-token check for admin routes, the rule that admin is never open beyond loopback, the request
body size limit, and running a server until it answers, either on a daemon
thread of this process (`ServerThread`, `serve_app`) or as a child process (`ServerProcess`).

uvicorn and httpx are imported inside the functions that use them: loading a run config imports
this module and must not pay for them.
Non-goals: routing and HTTP apps (each server builds its own app); choosing which address a node
advertises (orchestration/ray_cluster.py does that); supervising or restarting servers (the engine
fleet does that).
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Self

from miles import owners
from miles.config import ConfigError

LOOPBACK = "127.0.0.1"
"""Where a server started on its own (`miles serve`, `miles router`, `miles sessions`, `miles report
--serve`) binds by default: the one loopback address written down in miles. Inside a run every address
comes from the Ray node (ray_cluster.py), whose local default is derived from this one."""

UNAUTHORIZED = "admin endpoint: send header 'Authorization: Bearer <admin token>'"
"""The 401 body every admin route answers with when the token is missing or wrong."""


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), IPv6 when host has a colon; port 0 picks a free one.

    Servers bind before they serve so the port is known (and held) before anyone is told the URL.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit TCP_NODELAY (Linux). Without it a keep-alive reply written in two
    # pieces (headers, then body, as uvicorn's h11 protocol writes it) waits for the client's delayed
    # ACK of the first: about 40 ms added to every request after a connection's first.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    """The http URL a bound socket is reached at (IPv6 hosts in brackets)."""
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def free_port(host: str = LOOPBACK) -> int:
    """A port free on `host` right now (for rendezvous that take a port number, not a socket)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bearer_headers(token: str | None) -> dict[str, str]:
    """The Authorization header that admin routes expect; empty when the server has no token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def bearer_ok(authorization: str | None, token: str | None) -> bool:
    """Whether an Authorization header value carries `token` (always True when no token is set).

    Compared in constant time so the token cannot be guessed byte by byte from response times.
    """
    if token is None:
        return True
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode())


def resolve(name: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses a host name resolves to here (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):
        return set()
    return {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only: a loopback address, or a
    name that resolves to loopback addresses only (as the machine's own name for loopback does)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    addresses = resolve(host)  # a name binds whatever it resolves to
    return bool(addresses) and all(a.is_loopback for a in addresses)


def check_admin_exposure(host: str, admin_token: str | None, insecure_admin: bool, what: str) -> None:
    """Refuse to serve admin routes without a token on an address other machines can reach.

    Without a token every admin route (weight updates, aborting everyone's requests, worker
    membership) is open to whoever reaches the port, so such a server must stay on loopback unless
    its operator says in so many words that the network is trusted.
    """
    if admin_token is None and not insecure_admin and not is_loopback(host):
        raise ConfigError(f"{what} host = {host!r} without an admin token would open every admin route to "
                          "the network: set --admin-token T (clients send 'Authorization: Bearer T'), bind "
                          f"--host {LOOPBACK}, or pass --insecure-admin if the network is trusted")


DEFAULT_MAX_BODY_MB = 64.0
"""Largest request body a miles server reads by default; far above any real request."""


class BodyLimit:
    """ASGI middleware: a request body larger than `max_bytes` is answered 413 before the app sees it.

    The body is read here (up to the limit) and replayed to the app, so a chunked upload without a
    Content-Length is bounded too, and no handler ever buffers more than the limit.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, int(declared))
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(send, size)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int) -> None:
        content = json.dumps({"error": f"body: {size} bytes is more than this server's limit of {self.max_bytes} "
                              "bytes; send a smaller request"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(content)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": content})


def wait_until_answers(url: str, timeout_s: float, alive: Callable[[], bool]) -> bool:
    """Poll GET `url` until it answers with any HTTP status (True), or until `alive()` turns False or
    timeout_s passes (False). A server is up once it answers at all; what it answers is its own business."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            httpx.get(url, timeout=2)
            return True
        except httpx.TransportError:
            time.sleep(0.05)
    return False


class ServerThread:
    """A server's loop on a daemon thread of this process, reached at `.url`; `.stop()` ends it.

    `serve` runs the loop until `shutdown` (called from another thread) makes it return. `serve_app`
    builds one for an ASGI app; the dashboard's standard-library server passes its own loop.
    """

    def __init__(self, url: str, serve: Callable[[], object], shutdown: Callable[[], object], *, name: str):
        self.url = url
        self._shutdown = shutdown
        self._thread = threading.Thread(target=serve, name=name, daemon=True)
        self._thread.start()

    def wait_until_up(self, path: str, timeout_s: float, what: str) -> None:
        """Return once GET `path` answers; otherwise tell the loop to end and raise RuntimeError."""
        if not wait_until_answers(self.url + path, timeout_s, self._thread.is_alive):
            self._shutdown()
            raise RuntimeError(f"{what} at {self.url} did not answer {path} within {timeout_s}s")

    def stop(self, timeout_s: float = 30.0) -> None:
        self._shutdown()
        self._thread.join(timeout=timeout_s)


def serve_app(app, sock: socket.socket, host: str, *, what: str, ready_path: str, startup_timeout_s: float,
              log_level: str = "warning", **uvicorn_options) -> ServerThread:
    """Serve an ASGI `app` by uvicorn on the bound `sock` on a daemon thread (named for `what`); return
    once GET `ready_path` answers, or raise RuntimeError naming `what` after startup_timeout_s."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, **uvicorn_options))
    served = ServerThread(url_of(sock, host), functools.partial(server.run, sockets=[sock]),
                          functools.partial(setattr, server, "should_exit", True), name=f"miles {what}")
    served.wait_until_up(ready_path, startup_timeout_s, what)
    return served


PARENT_PID_ENV = "MILES_PARENT_PID"  # set by ServerProcess for its child: the process that started it


def exit_with_parent(check_every_s: float = 1.0) -> None:
    """In a server a ServerProcess started: end this process once the process that started it is gone.
    A SIGKILLed driver cannot stop its children, and an orphaned router would hold its port for good.
    A server started by hand (no MILES_PARENT_PID in its environment) is left alone."""
    parent = os.environ.get(PARENT_PID_ENV, "")
    if not parent.isdigit():
        return

    def watch() -> None:
        while owners.alive(int(parent)) and os.getppid() == int(parent):
            time.sleep(check_every_s)
        os._exit(0)

    threading.Thread(target=watch, name="miles-exit-with-parent", daemon=True).start()


class ServerProcess:
    """A miles server run as a child process, reached at `.url`; `.stop()` (or `with`) ends it.

    The constructor starts `cmd`, takes the URL from the first line of the child's output that
    `url_line` matches (its one group is the URL), and returns once GET `ready_path` answers there;
    otherwise it stops the child and raises RuntimeError with the child's last output.
    """

    def __init__(self, cmd: list[str], *, url_line: str, ready_path: str, startup_timeout_s: float, what: str,
                 env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, PARENT_PID_ENV: str(os.getpid()), **(env or {})})
        self.output: list[str] = []  # everything the child printed, for error messages
        self.url: str | None = None
        self._url_line = re.compile(url_line)
        self._url_found = threading.Event()
        drainer = threading.Thread(target=self._drain, daemon=True)
        drainer.start()

        def alive() -> bool:
            return self.proc.poll() is None

        deadline = time.monotonic() + startup_timeout_s
        while alive() and time.monotonic() < deadline:
            if self._url_found.wait(0.1):
                if wait_until_answers(self.url + ready_path, deadline - time.monotonic(), alive):
                    return
                break
        self.stop()
        drainer.join(timeout=5)  # the child has exited: its last lines are on their way to self.output
        raise RuntimeError(f"{what} did not answer {ready_path} within {startup_timeout_s}s "
                           f"(exit code {self.proc.returncode}); its output:\n{''.join(self.output[-50:])}")

    def _drain(self) -> None:
        # Always read the pipe, or a chatty child would block on a full pipe buffer.
        for line in self.proc.stdout:
            self.output.append(line)
            m = self._url_line.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._url_found.set()

    def stop(self, timeout_s: float = 15.0) -> None:
        terminate(self.proc, timeout_s)

    def __enter__(self) -> Self:
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
