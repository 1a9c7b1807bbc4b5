"""miles on a real two-node Ray cluster on this machine, and beside clusters it must not join.

The cluster: a head node at 127.0.0.3 marked with the custom resource `miles_trainer`, and a second
node at 127.0.0.4 marked `miles_engines`, each its own `ray start` (tests/helpers/ray_nodes.py).
Ray turns a head address of 127.0.0.1 into the machine's network address, so the nodes take other
loopback addresses: all traffic stays in 127.0.0.0/8, and an address taken from the wrong node (or a
hard-coded one) shows up as the wrong loopback address.

Runs go in child processes: this test process may already hold a connection to another cluster.
The test that leaves the cluster's address file stale kills the cluster, so it comes last.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from miles.orchestration.router_supervisor import RECORD
from tests.e2e.test_driver_kill import (check_nothing_lost_or_trained_twice, kill_at_checkpoint, resume,
                                       stopped_by_the_run, train_args)
from tests.helpers.ray_nodes import LocalCluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
HEAD, NODE2 = "127.0.0.3", "127.0.0.4"
LOOPBACK_NET = ipaddress.ip_network("127.0.0.0/8")

# Ray's own default (address=None) joins the latest cluster in the address file and refuses num_cpus;
# then miles starts a local cluster and reports it.
_LOCAL_RUN = """
import json, ray
from miles.orchestration.ray_cluster import ensure_ray
from miles.run_sections import RayConfig
try:
    ray.init(num_cpus=1, configure_logging=False)
    ray_default = "started"
except ValueError as exc:
    ray_default = str(exc)
ensure_ray(RayConfig(num_cpus=1))
print(json.dumps({"ray_default": ray_default, "gcs": ray.get_runtime_context().gcs_address,
                  "nodes": [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]],
                  "cpus": ray.cluster_resources().get("CPU")}))
"""

_TRAIN = """
import json, sys
from miles.orchestration.driver import run_train
from tests.helpers.runs import small_config
print(json.dumps(run_train(small_config(sys.argv[1], sys.argv[2], **json.loads(sys.argv[3])))))
"""


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(HEAD, resources={"miles_trainer": 1})
    try:
        c.add_node(NODE2, resources={"miles_engines": 1})
        assert c.alive_nodes() == [HEAD, NODE2]
        yield c
    finally:
        c.stop()


def _python(code: str, *args: str, env: dict | None = None, timeout: float = 600) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _local_run_beside(cluster: LocalCluster) -> dict:
    """A local run's cluster on a machine whose latest-cluster address file names `cluster`."""
    assert cluster.address_file.read_text().strip() == cluster.address
    return _python(_LOCAL_RUN, env={"RAY_TMPDIR": cluster.tmp})


def test_a_local_run_starts_its_own_cluster_beside_a_running_one(cluster):
    seen = _local_run_beside(cluster)
    assert "num_cpus" in seen["ray_default"]  # what `miles train` hit before
    assert seen["gcs"] != cluster.address
    assert seen["nodes"] == ["127.0.0.2"] and seen["cpus"] == 1


def _host(url: str) -> str:
    return urlparse(url).hostname


def _train_on_the_cluster(cluster: LocalCluster, model_dir: str, out_dir, **over) -> dict:
    """A short GRPO run joined to `cluster`, trainer on the head, engines on node 2; its summary."""
    over = {"ray.address": cluster.address, "ray.node_ip_address": HEAD, "loop.num_steps": "2",
            "eval.every_steps": "0", "eval.num_prompts": "4", "placement.trainer_nodes": "miles_trainer",
            "placement.engine_nodes": "miles_engines", **over}
    return _python(_TRAIN, model_dir, str(out_dir), json.dumps(over))


# broadcast runs in the default tier; the other transports' runs over two nodes are further variants (slow).
@pytest.mark.parametrize("transport", ["broadcast"] + [pytest.param(t, marks=pytest.mark.slow)
                                                       for t in ("disk_delta", "p2p")])
def test_grpo_with_trainer_on_the_head_and_engines_on_node_two(cluster, tiny_model_dir, tmp_path, transport):
    extra = {"sync.delta_dir": str(tmp_path / "deltas")} if transport == "disk_delta" else {}
    summary = _train_on_the_cluster(cluster, tiny_model_dir, tmp_path, **{"sync.transport": transport}, **extra)
    where = summary["cluster"]

    assert where["nodes"] == [HEAD, NODE2]  # joined, not a cluster of its own
    assert where["driver"] == HEAD and _host(where["router"]) == HEAD
    master_host, _, master_port = where["trainer"]["master"].rpartition(":")
    assert master_host == HEAD and int(master_port) > 0
    assert where["trainer"]["ranks"] == [HEAD]
    assert [(e["node"], _host(e["url"])) for e in where["engines"]] == [(NODE2, NODE2)]
    channel = where["engines"][0]["sync"]
    # p2p finds the engine on another node and takes the network path; rendezvous on the trainer's node.
    assert channel == {"broadcast": f"broadcast via {HEAD}", "disk_delta": "disk_delta",
                       "p2p": f"p2p tcp via {HEAD}"}[transport]
    seen = [*where["nodes"], where["driver"], _host(where["router"]), master_host, *where["trainer"]["ranks"],
            *(e["node"] for e in where["engines"]), *(_host(e["url"]) for e in where["engines"])]
    assert all(ipaddress.ip_address(a) in LOOPBACK_NET for a in seen), seen

    # Every step trained on samples generated under the previous push: the weights reached node 2.
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/weight_version"] for r in records[1:]] == [0, 1]
    assert summary["steps"] == 2


def test_an_engine_killed_on_node_two_is_replaced_there_and_the_run_completes(cluster, tiny_model_dir, tmp_path):
    # Two engines: requests (evaluation's too) go to the other one while the killed one is replaced, by
    # a standby engine (started with the others, on node 2 too), so the slot serves again within the run.
    # Killed as step 1's training starts, not at a time: a run faster or slower than expected still sees it.
    summary = _train_on_the_cluster(cluster, tiny_model_dir, tmp_path, **{
        "loop.num_steps": "3", "rollout.num_engines": "2", "health.standby_engines": "1",
        "health.interval_s": "0.2", "fault.kill_engine_at_steps": "1"})
    assert (summary["faults"]["kills"], summary["faults"]["recovered"]) == (1, 1)
    fleet = summary["fleet"]
    assert (fleet["replacements"], fleet["recovered"]) == (1, 1)
    event = fleet["events"][0]
    assert _host(event["old_url"]) == NODE2 and _host(event["new_url"]) == NODE2
    engines = summary["cluster"]["engines"]
    assert event["new_url"] in [e["url"] for e in engines] and event["old_url"] not in [e["url"] for e in engines]
    assert [(e["node"], _host(e["url"])) for e in engines] == [(NODE2, NODE2)] * 2
    assert summary["steps"] == 3


@pytest.mark.slow  # a variant of test_driver_kill.py's default-tier run, and of the detached engines' below
def test_a_killed_driver_on_a_joined_cluster_takes_its_engines_along_and_resume_adopts_its_router(
        cluster, tiny_model_dir, tmp_path):
    """On a cluster given by ray.address the engines are still the driver's Ray actors: its process group
    SIGKILLed, Ray ends them there too, while the router (on the driver's machine, a process of its own)
    keeps answering. `miles train --resume` joins the same cluster, starts new engines on node 2,
    registers them with the adopted router, and completes the run with nothing lost or trained twice."""
    run_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    args = train_args(tiny_model_dir, tmp_path, **{
        "ray.num_cpus": None, "ray.address": cluster.address, "ray.node_ip_address": HEAD,
        "placement.trainer_nodes": "miles_trainer", "placement.engine_nodes": "miles_engines"})
    router, killed_at = kill_at_checkpoint(args, env, run_dir, tmp_path / "first.log")
    old = httpx.get(router.url + "/list_workers", timeout=10).json()["urls"]  # its engines when the driver died
    try:
        assert [_host(u) for u in old] == [NODE2]
        deadline = time.monotonic() + 60
        while any(_answers(u) for u in old):  # ended by Ray on node 2, though the cluster lives on
            assert time.monotonic() < deadline, f"the killed driver's engines {old} still answer after 60 s"
            time.sleep(0.5)
        while httpx.get(router.url + "/health", timeout=10).status_code != 503:  # up, and sees no engine left
            assert time.monotonic() < deadline + 30, "the router did not see its engines gone within 30 s"
            time.sleep(0.5)
        resumed = resume(run_dir, env)
    finally:
        ended = stopped_by_the_run(router)
    assert f"router at {router.url} (adopted: pid {router.pid}" in resumed.stderr, resumed.stderr[-3000:]
    assert ended and not (run_dir / RECORD).exists()
    summary = check_nothing_lost_or_trained_twice(run_dir, killed_at)
    engines = summary["cluster"]["engines"]
    assert [(e["node"], _host(e["url"])) for e in engines] == [(NODE2, NODE2)] and engines[0]["url"] not in old
    assert summary["router"]["adopted"] and summary["cluster"]["nodes"] == [HEAD, NODE2]


def test_detached_engines_outlive_a_killed_driver_and_resume_adopts_them(cluster, tiny_model_dir, tmp_path):
    """ray.detached_engines: the engine on node 2 and the router outlive the driver's process group, the
    router keeps serving it (/health 200); `miles train --resume` adopts both (the same engine, continued,
    given the checkpoint's weights), completes the run with nothing lost or trained twice, and ends the
    engine at the run's end."""
    run_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    args = train_args(tiny_model_dir, tmp_path, **{
        "ray.num_cpus": None, "ray.address": cluster.address, "ray.node_ip_address": HEAD,
        "ray.detached_engines": "true", "placement.trainer_nodes": "miles_trainer",
        "placement.engine_nodes": "miles_engines"})
    router, killed_at = kill_at_checkpoint(args, env, run_dir, tmp_path / "first.log")
    old = httpx.get(router.url + "/list_workers", timeout=10).json()["urls"]  # its engines when the driver died
    try:
        time.sleep(3.0)  # past a few of the router's health rounds without the driver
        assert [_host(u) for u in old] == [NODE2] and all(_answers(u) for u in old)
        health = httpx.get(router.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["active_workers"] == 1, health.text
        resumed = resume(run_dir, env)
    finally:
        ended = stopped_by_the_run(router)
    assert f"adopted 1 detached engines left serving by the previous driver: {old[0]}" in resumed.stderr, \
        resumed.stderr[-3000:]
    assert f"router at {router.url} (adopted: pid {router.pid}" in resumed.stderr
    assert ended and not (run_dir / RECORD).exists()
    summary = check_nothing_lost_or_trained_twice(run_dir, killed_at)
    assert [e["url"] for e in summary["cluster"]["engines"]] == old  # the same engine, never restarted
    deadline = time.monotonic() + 30
    while _answers(old[0]):  # stopped at the run's end like any engine of the run
        assert time.monotonic() < deadline, "the adopted engine outlived the run's end"
        time.sleep(0.5)


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


def test_a_local_run_starts_its_own_cluster_when_the_latest_one_is_gone(cluster):
    for i in reversed(range(len(cluster.procs))):
        cluster.stop_node(i)
    seen = _local_run_beside(cluster)  # the address file still names the dead cluster
    assert "num_cpus" in seen["ray_default"]
    assert seen["gcs"] != cluster.address
    assert seen["nodes"] == ["127.0.0.2"] and seen["cpus"] == 1
