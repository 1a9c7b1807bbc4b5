"""Which cluster a run uses: its own unless ray.address (or RAY_ADDRESS) names one to join. The
behaviour against real clusters on this machine is tested in tests/e2e/test_cluster.py."""

import pytest

from miles.config.loader import ConfigError
from miles.run_sections import RayConfig, cluster_address


def test_a_joined_cluster_keeps_its_cpus_so_num_cpus_with_an_address_is_refused():
    with pytest.raises(ConfigError, match="ray.num_cpus = 4 with ray.address = '10.0.0.1:6379'.*unset ray.num_cpus"):
        RayConfig(address="10.0.0.1:6379", num_cpus=4).validate()


def test_only_an_address_given_joins_a_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(RayConfig()) is None  # a local cluster of the run's own
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address(RayConfig()) == "10.0.0.1:6379"
    assert cluster_address(RayConfig(address="auto")) == "auto"
