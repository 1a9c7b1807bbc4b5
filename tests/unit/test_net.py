"""Running a server until it answers: on a thread of this process or as a child process. A server
that never answers is reported by name (with a child's own output) and told to stop. And the one
loopback address miles writes down: the default bind of a server started on its own."""

import ipaddress
import re
import sys
import threading
from pathlib import Path

import httpx
import pytest

import miles
from miles.net import LOOPBACK, ServerProcess, ServerThread, bind, is_loopback, url_of
from miles.run_sections import LOCAL_NODE_ADDRESS
from miles.engine.server import parse_args as serve_args
from miles.rollout.router.app import parse_args as router_args


def test_a_thread_server_that_never_answers_is_named_and_stopped():
    sock = bind("127.0.0.1", 0)  # bound but never listening: connections are refused
    stopped = threading.Event()
    served = ServerThread(url_of(sock, "127.0.0.1"), stopped.wait, stopped.set, name="test")
    try:
        with pytest.raises(RuntimeError, match=r"toy server at http://127\.0\.0\.1:\d+ did not answer /health"):
            served.wait_until_up("/health", 0.5, "toy server")
        assert stopped.is_set()
    finally:
        sock.close()


def test_a_child_server_is_found_by_its_url_line_and_stopped():
    cmd = [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1"]
    with ServerProcess(cmd, url_line=r"\((http://\S+?)/?\)", ready_path="/", startup_timeout_s=30,
                       what="http.server") as proc:
        assert httpx.get(proc.url + "/").status_code == 200
    assert proc.proc.poll() is not None


def test_a_child_that_exits_before_answering_is_reported_with_its_output():
    cmd = [sys.executable, "-c", "print('no port for you'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)toy process did not answer /health .*exit code 3.*no port for you"):
        ServerProcess(cmd, url_line=r"at (http://\S+)", ready_path="/health", startup_timeout_s=30, what="toy process")


# A loopback address written into miles: an IPv4 127.x.y.z, the name localhost, or IPv6's ::1.
LOOPBACK_LITERAL = re.compile(r"\b127\.\d{1,3}\.\d{1,3}\.|localhost|(?<![0-9a-fA-F:])::1\b", re.IGNORECASE)


def test_the_standalone_serve_default_is_the_only_loopback_address_written_in_miles():
    package = Path(miles.__file__).parent
    found = [(str(path.relative_to(package.parent)), line.strip())
             for path in sorted(package.rglob("*.py")) for line in path.read_text().splitlines()
             if LOOPBACK_LITERAL.search(line)]
    assert found == [("miles/net.py", 'LOOPBACK = "127.0.0.1"')], found
    # Which standalone servers default to it, and that a local cluster's node is derived from it.
    assert serve_args(["--model", "/m"])[0].host == router_args([]).router.host == LOOPBACK
    assert ipaddress.ip_address(LOCAL_NODE_ADDRESS).is_loopback and LOCAL_NODE_ADDRESS != LOOPBACK


def test_loopback_names_count_as_loopback_by_what_they_resolve_to():
    assert is_loopback("localhost") and is_loopback("::1") and is_loopback("[::1]") and is_loopback("127.0.0.9")
    assert not is_loopback("0.0.0.0") and not is_loopback("no-such-host.invalid")


def test_connections_a_server_accepts_send_without_waiting_for_acks():
    """Replies go out as written (TCP_NODELAY): a keep-alive reply sent as headers then body would
    otherwise wait for the client's delayed ACK of the headers, about 40 ms per request."""
    import socket

    sock = bind("127.0.0.1", 0)
    sock.listen(1)
    try:
        with socket.create_connection(sock.getsockname()[:2]) as client:
            conn, _ = sock.accept()
            with conn:
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
                client.sendall(b"x")
                assert conn.recv(1) == b"x"
    finally:
        sock.close()
