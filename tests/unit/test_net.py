"""Serving on a thread: a server that never answers is reported by name and told to stop."""

import threading

import pytest

from miles.net import ServerThread, bind, url_of


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
