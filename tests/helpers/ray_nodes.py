"""Ray nodes started by `ray start --block`, each in its own process group, for tests that need a
cluster other than the one a run starts itself.

Every node of a LocalCluster shares one temp dir of its own (RAY_TMPDIR), so the address file Ray
keeps of "the latest cluster" is written there, never into the machine's /tmp/ray that other Ray
users on this machine read. Nodes are stopped by killing the process groups started here: never
`ray stop`, which ends every Ray process on the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from miles.net import free_port

RAY = str(Path(sys.executable).with_name("ray"))


class LocalCluster:
    """A head node at `head_ip` (more nodes with `add_node`), sized small: one CPU, 100 MB of object store."""

    def __init__(self, head_ip: str, *, num_cpus: int = 1, resources: dict[str, float] | None = None):
        # Short: Ray's unix socket paths live under it and must stay under 108 bytes.
        self.tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")
        self.env = {**os.environ, "RAY_TMPDIR": self.tmp, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        self.procs: list[subprocess.Popen] = []
        self.head_ip = head_ip
        self.port = free_port(head_ip)
        self.address = f"{head_ip}:{self.port}"
        try:
            self._start(head_ip, ["--head", "--port", str(self.port), "--include-dashboard", "false",
                                  "--ray-client-server-port", str(free_port(head_ip))], num_cpus, resources)
        except BaseException:
            self.stop()
            raise

    @property
    def address_file(self) -> Path:
        """Where Ray records this cluster as the latest one, as `ray start` does in /tmp/ray."""
        return Path(self.tmp) / "ray" / "ray_current_cluster"

    def add_node(self, ip: str, *, num_cpus: int = 1, resources: dict[str, float] | None = None) -> None:
        self._start(ip, ["--address", self.address], num_cpus, resources)

    def _start(self, ip: str, role: list[str], num_cpus: int, resources: dict[str, float] | None) -> None:
        import json

        cmd = [RAY, "start", "--block", *role, "--node-ip-address", ip, "--num-cpus", str(num_cpus),
               "--object-store-memory", str(100 * 1000 * 1000), "--disable-usage-stats",
               "--dashboard-agent-listen-port", str(free_port(ip)), "--metrics-export-port", str(free_port(ip))]
        if resources:
            cmd += ["--resources", json.dumps(resources)]
        expected = len(self.procs) + 1
        proc = subprocess.Popen(cmd, env=self.env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        self._wait_for_nodes(expected, proc)

    def alive_nodes(self) -> list[str]:
        """The addresses of the cluster's live nodes, as its GCS lists them (no driver connection, so
        this process stays free to join or start any cluster)."""
        from ray._raylet import GcsClient

        nodes = GcsClient(address=self.address).get_all_node_info(timeout=5).values()
        return sorted(n.node_manager_address for n in nodes if n.state == 0)  # 0: ALIVE

    def _wait_for_nodes(self, n: int, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {proc.returncode}: {proc.args}")
            if self.address_file.exists():
                try:
                    if len(self.alive_nodes()) == n:
                        return
                except Exception:  # noqa: BLE001 - the GCS is not answering yet
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"the cluster at {self.address} did not reach {n} nodes within {timeout_s}s")

    def stop_node(self, index: int) -> None:
        """Kill every process of one node: its `ray start` was a session leader, so they all carry its
        session id (raylet, GCS on the head, workers, which may have moved to process groups of their own)."""
        proc = self.procs[index]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        for pid in _session_members(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        for i in reversed(range(len(self.procs))):
            self.stop_node(i)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _session_members(sid: int) -> list[int]:
    """Live processes of session `sid` (field 6 of /proc/PID/stat)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(entry))
    return members
