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
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.helpers.ray_nodes import LocalCluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
HEAD, NODE2 = "127.0.0.3", "127.0.0.4"
LOOPBACK_NET = ipaddress.ip_network("127.0.0.0/8")

# Ray's own default (address=None) joins the latest cluster in the address file and refuses num_cpus;
# then miles starts a local cluster and reports it.
_LOCAL_RUN = """
import json, ray
from miles.orchestration.ray_cluster import RayConfig, ensure_ray
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


def test_a_local_run_starts_its_own_cluster_when_the_latest_one_is_gone(cluster):
    for i in reversed(range(len(cluster.procs))):
        cluster.stop_node(i)
    seen = _local_run_beside(cluster)  # the address file still names the dead cluster
    assert "num_cpus" in seen["ray_default"]
    assert seen["gcs"] != cluster.address
    assert seen["nodes"] == ["127.0.0.2"] and seen["cpus"] == 1
