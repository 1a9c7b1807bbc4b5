"""Running a server until it answers: on a thread of this process or as a child process. A server
that never answers is reported by name (with a child's own output) and told to stop."""

import sys
import threading

import httpx
import pytest

from miles.net import ServerProcess, ServerThread, bind, url_of


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
