"""Joining or starting the Ray cluster that hosts engines, trainer ranks and the rollout manager."""

from __future__ import annotations

import os
from dataclasses import dataclass

from miles.config.loader import ConfigError


@dataclass
class RayConfig:
    address: str | None = None
    """Existing cluster to join (e.g. "ray://host:10001" or "auto"); None starts a local one."""
    num_cpus: int | None = None
    """Logical CPUs of a local cluster (None = this machine's count)."""

    def validate(self) -> None:
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"ray.num_cpus = {self.num_cpus}: set it >= 1, or leave it unset for this "
                              "machine's count")


def ensure_ray(cfg: RayConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Actors share the package from this environment; no runtime_env upload is needed locally.
    ray.init(address=cfg.address, num_cpus=cfg.num_cpus if cfg.address is None else None,
             include_dashboard=False, log_to_driver=True, configure_logging=False)
