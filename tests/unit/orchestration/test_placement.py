"""Pinning a process to its pool pins the threads it already runs, not only the calling one."""

import os
import threading

import pytest

from miles.orchestration.placement import pin_current_process

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux CPU affinity and two cores")


def test_pin_reaches_threads_started_before_it():
    original = os.sched_getaffinity(0)
    first = min(original)
    started, release = threading.Event(), threading.Event()
    tid = {}

    def worker():
        tid["id"] = threading.get_native_id()
        started.set()
        release.wait(10)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    started.wait(5)
    try:
        pin_current_process((first,))
        assert os.sched_getaffinity(tid["id"]) == {first}
        assert os.sched_getaffinity(0) == {first}
    finally:
        release.set()
        t.join(5)
        pin_current_process(tuple(sorted(original)))
    assert os.sched_getaffinity(0) == original
