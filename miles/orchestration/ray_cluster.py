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

import ipaddress
import os
from dataclasses import dataclass

from miles.config.loader import ConfigError
from miles.net import LOOPBACK

NAMESPACE = "miles"
"""The Ray namespace of a run with detached engines (ray.detached_engines), where its engines and their
placement group are named."""

LOCAL_NODE_ADDRESS = str(ipaddress.ip_address(LOOPBACK) + 1)
"""The address a local cluster's node advertises: loopback, and one Ray keeps as given (the address
after LOOPBACK, so a local run's traffic stays on loopback while Ray leaves its address alone)."""


@dataclass
class RayConfig:
    address: str | None = None
    """Existing cluster to join (e.g. "10.0.0.1:6379", "auto" for the latest `ray start` on this machine,
    or "ray://host:10001"); the environment variable RAY_ADDRESS counts as this key. None starts a
    local cluster of the run's own, even when another runs on this machine."""
    num_cpus: int | None = None
    """Logical CPUs of a local cluster (None = this machine's count); refused with `address`."""
    node_ip_address: str | None = None
    """Address of this machine's Ray node: a local cluster's node advertises it; when joining, the node
    of this machine that the driver attaches to (the --node-ip-address it was started with). None:
    LOCAL_NODE_ADDRESS (loopback) for a local cluster, Ray's choice when joining."""
    detached_engines: bool = False
    """On a joined cluster (ray.address): start the run's engines as detached Ray actors that outlive a
    killed driver, for `miles train --resume` to adopt; each ends itself once no driver renewed its
    lease for engine_lease_s."""
    engine_lease_s: float = 600.0
    """How long a detached engine serves on after its last driver stopped renewing its lease (seconds)."""

    def validate(self) -> None:
        if self.detached_engines and cluster_address(self) is None:
            raise ConfigError("ray.detached_engines needs a cluster that outlives the driver: set ray.address (or "
                              "RAY_ADDRESS); a local cluster ends with its driver, engines included")
        if self.engine_lease_s <= 0:
            raise ConfigError(f"ray.engine_lease_s = {self.engine_lease_s}: set it > 0 (seconds)")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"ray.num_cpus = {self.num_cpus}: set it >= 1, or leave it unset for this "
                              "machine's count")
        if self.address is not None and self.num_cpus is not None:
            raise ConfigError(f"ray.num_cpus = {self.num_cpus} with ray.address = {self.address!r}: a cluster "
                              "that is joined keeps the CPUs it was started with; unset ray.num_cpus, or unset "
                              "ray.address to start a local cluster")


def cluster_address(cfg: RayConfig) -> str | None:
    """The cluster to join: ray.address, else RAY_ADDRESS; None means start a local one."""
    return cfg.address or os.environ.get("RAY_ADDRESS") or None


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
