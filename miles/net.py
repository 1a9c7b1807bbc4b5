"""Network plumbing every miles server and client shares: listening sockets, free ports, and the one
bearer-token check for admin routes.

Non-goals: routing and HTTP apps (each server builds its own FastAPI app); choosing which address a
node advertises (placement does that).
"""

from __future__ import annotations

import hmac
import socket

UNAUTHORIZED = "admin endpoint: send header 'Authorization: Bearer <admin token>'"
"""The 401 body every admin route answers with when the token is missing or wrong."""


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), IPv6 when host has a colon; port 0 picks a free one.

    Servers bind before they serve so the port is known (and held) before anyone is told the URL.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    """The http URL a bound socket is reached at (IPv6 hosts in brackets)."""
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
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
