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


def test_colocated_refuses_trainer_and_engines_named_on_different_nodes():
    from miles.config.loader import ConfigError
    from miles.run_sections import PlacementConfig

    with pytest.raises(ConfigError, match="placement.trainer_nodes.*placement.engine_nodes.*disaggregated"):
        PlacementConfig(mode="colocated", trainer_nodes="gpu_a", engine_nodes="gpu_b").validate()
    PlacementConfig(mode="colocated", trainer_nodes="gpu_a", engine_nodes="gpu_a").validate()


def test_pools_on_nodes_of_their_own_keep_every_core():
    from miles.orchestration.placement import core_pools
    from miles.run_sections import PlacementConfig

    assert core_pools(PlacementConfig(trainer_nodes="trainer", engine_nodes="engines")) is None
    shared = core_pools(PlacementConfig())
    assert shared is not None and not set(shared.engine) & set(shared.trainer)


def test_a_pool_on_nodes_no_node_offers_is_refused_naming_the_key_and_the_fix(ray_cluster):
    from miles.orchestration.placement import NodePool, PlacementError

    with pytest.raises(PlacementError, match=r"placement.engine_nodes = 'gpu_nodes'.*ray start --resources"):
        NodePool("engines", 1, "gpu_nodes", "placement.engine_nodes", timeout_s=5)
    pool = NodePool("engines", 2, "", "placement.engine_nodes", timeout_s=30)  # any node
    try:
        assert pool.options(3)["scheduling_strategy"].placement_group_bundle_index == 1
    finally:
        pool.remove()
