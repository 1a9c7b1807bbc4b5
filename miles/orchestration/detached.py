"""A run's detached engines (ray.detached_engines, on a joined cluster): engine actors and their placement
group that outlive a killed driver, named after the run so that `miles train --resume` finds them again.

    driver: each engine it starts is named miles-engine-<run key>-<random>, lifetime "detached", in the
        namespace every driver of the run joins (ray_cluster.NAMESPACE); its lease renewed (lease.py)
    driver killed ─► the engines keep serving behind the router (which outlives it too)
    `--resume` ─► left_behind(): the run's named engines still alive ─► adopted (continued, relabelled
        and given the checkpoint's weights by the restore) ─► the rest of the fleet started anew
    no `--resume` within ray.engine_lease_s ─► each engine ends itself

The run key is the run directory's absolute path, hashed: a run's drivers share it, other runs do not.
A run that ends normally stops its engines and removes their placement group as any run does.
Non-goals: the trainer ranks and the rollout manager (restored from the checkpoint, never adopted).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from pathlib import Path

from miles.orchestration.lease import LeaseRenewer
from miles.run_sections import NAMESPACE

log = logging.getLogger(__name__)


def run_key(run_dir: Path) -> str:
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


class DetachedEngines:
    """Names, leases and adoption of one run's detached engine actors."""

    def __init__(self, run_dir: Path, lease_s: float):
        key = run_key(run_dir)
        self.prefix = f"miles-engine-{key}-"
        self.group_name = f"miles-engines-{key}"  # their placement group's
        self.lease_s = lease_s
        self.actors: list = []  # the engine actors this driver holds, whose leases it renews
        self._renewer = LeaseRenewer(lease_s, lambda: list(self.actors), lambda a: a.renew_lease.remote())

    def options(self) -> dict:
        """Ray options of one more engine of the run."""
        return {"name": self.prefix + secrets.token_hex(4), "namespace": NAMESPACE, "lifetime": "detached"}

    def track(self, actor) -> None:
        self.actors.append(actor)

    def forget(self, actor) -> None:
        if actor in self.actors:
            self.actors.remove(actor)

    def left_behind(self) -> list:
        """The run's engine actors an earlier driver left (alive or not), oldest names first."""
        import ray

        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a.get("namespace") == NAMESPACE and a["name"].startswith(self.prefix))
        actors = []
        for name in names:
            try:
                actors.append(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:  # gone since it was listed
                continue
        return actors

    def stop(self) -> None:
        self._renewer.stop()
