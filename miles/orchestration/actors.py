"""Ray actor shells around components that know nothing about Ray.

Each shell pins its process to its placement pool, sets torch's thread count, and forwards calls.
All actors ask Ray for no logical CPUs: cores are assigned by placement, not by Ray's scheduler.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineShell:
    """One built-in engine serving the engine HTTP API from inside a Ray actor's process."""

    def __init__(self, engine_config, cores=None):
        from miles.orchestration.placement import pin_current_process
        from miles.rollout.engine.server import start_server_thread

        pin_current_process(cores)
        self.server = start_server_thread(engine_config)

    def url(self) -> str:
        return self.server.url

    def pid(self) -> int:
        import os

        return os.getpid()

    def stop(self) -> None:
        self.server.stop()


class TrainerShell:
    """One FSDP2 rank. Rank 0 also owns the weight transport towards the engines."""

    def __init__(self, trainer_cfg, sync_cfg, model_path: str, rank: int, world_size: int, master_port: int,
                 seed: int, temperature: float, cores=None, admin_token: str | None = None):
        from miles.orchestration.placement import pin_current_process
        from miles.trainer.backends.fsdp import FSDPTrainer

        pin_current_process(cores)
        self.trainer = FSDPTrainer(trainer_cfg, model_path, rank, world_size, "127.0.0.1", master_port,
                                   seed=seed, temperature=temperature)
        self.sync_cfg, self.rank, self.admin_token = sync_cfg, rank, admin_token
        self.transport = None

    def train_step(self, seqs, global_loss_tokens: int, kind: str = "rl"):
        return self.trainer.train_step(seqs, global_loss_tokens, kind)

    def connect_engines(self, urls: list[str]) -> None:
        if self.rank != 0:
            return
        from miles.sync.updater import WeightUpdater

        self.transport = WeightUpdater(self.sync_cfg, self.admin_token, base_path=self.trainer.model_path)
        self.transport.connect(urls)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Collective: every rank gathers; rank 0 converts, buckets, sends and verifies (sync/updater.py)."""
        named = self.trainer.full_named_tensors()
        if self.rank != 0:
            for _ in named:
                pass
            return {}
        if self.transport is None:
            raise RuntimeError("sync_weights before connect_engines: the trainer has no route to the engines")
        return self.transport.push(named, version)

    def save_hf(self, out_dir: str):
        return self.trainer.save_hf(out_dir)

    def call_trainer(self, method: str, *args):
        """Forward any other trainer call (checkpoint save/load, ...) without a shell method each."""
        return getattr(self.trainer, method)(*args)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def remote(cls, max_concurrency: int = 1):
    """Wrap a shell as a Ray actor class that takes no logical CPUs.

    max_concurrency > 1 runs calls on a thread pool, so one call may block (a trainer waiting for
    groups) while others (version updates, evaluation) proceed.
    """
    import ray

    return ray.remote(num_cpus=0, max_concurrency=max_concurrency)(cls)
