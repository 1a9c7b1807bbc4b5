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

def test_auto_threads_are_each_processs_share_of_its_pools_cores():
    """num_threads = 0: colocated, engine and trainer each take every core (they take turns);
    disaggregated, each pool's cores are shared by its processes; set counts stay as they are."""
    from miles.config.loader import load_config
    from miles.devices import cpu_threads
    from miles.orchestration.placement import CorePools, resolve_threads
    from miles.run_config import RunConfig

    def threads(pools, **over):
        cfg = load_config(RunConfig, None, {"model.path": "m", "trainer.num_threads": "0",
                                            "rollout.engine.num_threads": "0", **over})
        cfg = resolve_threads(cfg, pools)
        return cfg.rollout.engine.num_threads, cfg.trainer.num_threads

    every = tuple(range(8))
    assert threads(CorePools(engine=every, trainer=every)) == (8, 8)
    assert threads(CorePools(engine=every[:4], trainer=every[4:]), **{"rollout.num_engines": "2"}) == (2, 4)
    assert threads(CorePools(engine=every[:1], trainer=every[1:]), **{"trainer.num_ranks": "2"}) == (1, 3)
    assert threads(CorePools(engine=every[:1], trainer=every[1:]), **{"rollout.num_engines": "3"}) == (1, 7)
    assert threads(CorePools(engine=every, trainer=every), **{"trainer.num_threads": "2"}) == (8, 2)
    assert threads(None) == (0, 0)  # each process then takes the cores it may use
    assert cpu_threads(0) == len(os.sched_getaffinity(0)) and cpu_threads(3) == 3
