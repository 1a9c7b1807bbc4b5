"""TrainerGroup: the FSDP2 ranks as Ray actors, driven together.

Splits a global batch across ranks, counts the global loss tokens once (so normalisation does not
depend on the split), and runs collective calls (train step, weight sync, export) on every rank.
"""

from __future__ import annotations


class TrainerGroup:
    def __init__(self, trainer_cfg, sync_cfg, model_path: str, seed: int, temperature: float,
                 cores=None, admin_token: str | None = None):
        import ray

        from miles.orchestration.actors import TrainerShell, free_port, remote

        n = trainer_cfg.num_ranks
        port = free_port()
        cls = remote(TrainerShell)
        self.actors = [cls.remote(trainer_cfg, sync_cfg, model_path, r, n, port, seed, temperature, cores,
                                  admin_token) for r in range(n)]
        self._ray = ray

    def _all(self, method: str, *args_per_rank):
        refs = [getattr(a, method).remote(*(args[r] for args in args_per_rank)) for r, a in enumerate(self.actors)]
        return self._ray.get(refs)

    def train_step(self, seqs, kind: str = "rl") -> dict[str, float]:
        n = len(self.actors)
        shards = [seqs[r::n] for r in range(n)]
        total = sum(s.num_loss_tokens for s in seqs)
        return self._all("train_step", shards, [total] * n, [kind] * n)[0]

    def connect_engines(self, urls: list[str]) -> None:
        self._all("connect_engines", [urls] * len(self.actors))

    def sync_weights(self, version: int) -> dict[str, float]:
        return self._all("sync_weights", [version] * len(self.actors))[0]

    def save_hf(self, out_dir: str) -> str:
        return self._all("save_hf", [out_dir] * len(self.actors))[0]

    def close(self) -> None:
        self._all("close")
        for a in self.actors:
            self._ray.kill(a)
