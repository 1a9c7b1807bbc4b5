"""Joining or starting the Ray cluster that hosts engines, trainer ranks and the rollout manager.

Without `ray.address` a run starts a cluster of its own, always. Ray's own default
(`ray.init(address=None)`) would join the latest cluster a `ray start` left on this machine (Ray keeps
its address in /tmp/ray/ray_current_cluster, even after that cluster is gone) and then refuse the
run's num_cpus; a run must not depend on what else runs on the machine.

A local cluster's node advertises a loopback address, so everything a local run starts is reached on
loopback only. Ray replaces the usual loopback address (net.LOOPBACK) with the machine's network
address, so the node advertises the next one, LOCAL_NODE_ADDRESS, which Ray keeps as given.
Non-goals: starting nodes on other machines (`ray start` does that), the cluster's own security.
"""

from __future__ import annotations

import os

from miles.run_sections import LOCAL_NODE_ADDRESS, NAMESPACE, RayConfig, cluster_address


def ensure_ray(cfg: RayConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    address = cluster_address(cfg)
    # Actors share the package from this environment; no runtime_env upload is needed locally.
    common = dict(include_dashboard=False, log_to_driver=True, configure_logging=False)
    if address is None:
        # "local": a new cluster even when another is running or its address file is stale.
        ray.init(address="local", num_cpus=cfg.num_cpus, _node_ip_address=cfg.node_ip_address or LOCAL_NODE_ADDRESS,
                 **common)
    else:
        # Detached engines are found again by name, in a namespace every driver of a run joins.
        namespace = {"namespace": NAMESPACE} if cfg.detached_engines else {}
        ray.init(address=address, _node_ip_address=cfg.node_ip_address, **namespace, **common)


def node_address() -> str:
    """The address of the Ray node this process runs on: what its servers bind to and advertise."""
    import ray

    return ray.util.get_node_ip_address()
