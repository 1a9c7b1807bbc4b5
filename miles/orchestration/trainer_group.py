"""TrainerGroup: the trainer ranks as Ray actors, driven together.

Hands rollout groups to the trainer side (trainer/batching.py's `build_step` makes the step's batch:
the algorithm's advantages and each minibatch's global totals, once, so loss normalisation does not
depend on the split), splits it across data-parallel ranks, and runs collective calls (train step,
weight sync, export, checkpoints) on every rank.

Start-up is two calls: rank 0 picks the group's master on its own node (address and port), then
every rank joins it; so the rendezvous lives wherever placement put rank 0, on any node.
"""

from __future__ import annotations

from miles.orchestration.actors import CollectiveTimeout, TrainerShell, remote
from miles.trainer.algorithms import AlgorithmConfig, get_algorithm
from miles.trainer.batching import build_step, split_step
from miles.trainer.types import StepBatch


def split_for_ranks(seqs, num_ranks: int, tp: int) -> list[list]:
    """Data shards per rank: ranks of one tensor-parallel group get the same shard."""
    dp = num_ranks // tp
    shards = [seqs[d::dp] for d in range(dp)]
    return [shards[r // tp] for r in range(num_ranks)]


def join_from_ranks(per_rank: list[list], num_ranks: int, tp: int) -> list:
    """The inverse of `split_for_ranks` for per-sequence results: back in the global order (a data
    shard's tensor-parallel peers returned the same, the first one's is taken)."""
    dp = num_ranks // tp
    out: list = [None] * sum(len(per_rank[d * tp]) for d in range(dp))
    for d in range(dp):  # shard d holds seqs[d::dp]
        out[d::dp] = per_rank[d * tp]
    return out


class TrainerGroup:
    def __init__(self, trainer_cfg, sync_cfg, model_path: str, seed: int, temperature: float,
                 cores=None, admin_token: str | None = None, pool=None):
        """`pool`: the NodePool whose bundle r rank r runs in (None: wherever Ray schedules it)."""
        import ray

        n = trainer_cfg.num_ranks
        # The "checkpoint" group's thread waits for background checkpoint writes (from the driver's
        # writer thread) while the default group's thread trains.
        cls = remote(TrainerShell, concurrency_groups={"checkpoint": 1})
        self.cfg = trainer_cfg
        self.algorithm = get_algorithm(trainer_cfg.algorithm)
        # Ray hides every GPU from an actor that asks for none (CUDA_VISIBLE_DEVICES=""): a cuda rank
        # asks for its pool's share; without a pool, a whole GPU.
        gpu = {"num_gpus": 1} if trainer_cfg.device == "cuda" else {}
        self.actors = [cls.options(**(pool.options(r) if pool is not None else gpu)).remote(
            trainer_cfg, sync_cfg, model_path, r, n, seed, temperature, cores, admin_token) for r in range(n)]
        self._ray = ray
        self.failed = False
        self.closed = False
        try:
            host, port = self._gather("rendezvous", [self.actors[0].rendezvous.remote()])[0]
            self.master = f"{host}:{port}"
            self.nodes: list[str] = self._all("start", [host] * n, [port] * n)  # each rank's node address
        except BaseException:
            self.close()
            raise

    def _all(self, method: str, *args_per_rank):
        refs = [getattr(a, method).remote(*(args[r] for args in args_per_rank)) for r, a in enumerate(self.actors)]
        return self._gather(method, refs)

    def _gather(self, method: str, refs: list, settles: bool = True):
        """Every rank's result; the first rank that fails ends the call at once with a TrainerFailure
        (the other ranks are then stuck in a collective until its timeout, or already failed too).
        A call that `settles` marks the group healthy again when every rank answers; a call made
        beside the loop's (the checkpoint waits) does not, lest it hide a failure the loop just saw."""
        ray = self._ray
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 - re-raised with the rank and the way out
                rank = refs.index(done[0])
                self.failed = True
                raise TrainerFailure(f"trainer rank {rank} failed in {method}: {_first_line(exc)}. The step did "
                                     "not complete; continue from the last checkpoint with "
                                     "`miles train --resume RUN_DIR` (fault.restart_trainer = true "
                                     "does that in place)") from exc
        if settles:
            self.failed = False
        return ray.get(refs)

    def train_groups(self, groups) -> dict[str, float]:
        """One step on rollout groups, with the configured algorithm's advantages: as many optimizer
        updates as `trainer.minibatches_per_step`, each on whole groups."""
        step = build_step(groups, self.algorithm, self.cfg.minibatches_per_step, self.proximal_logprobs)
        return {**self._train(step), **step.metrics}

    def proximal_logprobs(self, seqs) -> list[list[float]]:
        """Each sequence's response logprobs under the trainer's current weights (one collective forward)."""
        n = len(self.actors)
        tp = self.cfg.replica_ranks  # consecutive ranks training one data shard
        per_rank = self._all("call_trainer", ["proximal_logprobs"] * n, split_for_ranks(seqs, n, tp))
        return join_from_ranks(per_rank, n, tp)

    def train_step(self, seqs, algorithm: str | None = None) -> dict[str, float]:
        """One optimizer update on sequences carrying per-sample advantages; `algorithm` names another
        algorithm's loss for this step (e.g. "sft" on demonstrations), None = the configured one."""
        algo = self.algorithm if algorithm is None else get_algorithm(AlgorithmConfig(name=algorithm))
        return self._train(split_step(seqs, algo), algorithm)

    def _train(self, step: StepBatch, algorithm: str | None = None) -> dict[str, float]:
        """Every minibatch of `step` split over the data-parallel ranks, then one train call per rank."""
        n = len(self.actors)
        tp = self.cfg.replica_ranks  # consecutive ranks training one data shard
        per_rank: list[list] = [[] for _ in range(n)]
        for part, totals in step.minibatches:
            for r, shard in enumerate(split_for_ranks(part, n, tp)):
                per_rank[r].append((shard, totals))
        return self._all("train_step", per_rank, [algorithm] * n)[0]

    def connect_engines(self, urls: list[str]) -> None:
        if self._all("connect_engines", [urls] * len(self.actors))[0]:
            self._all("check_engines_start")

    def reconnect_engines(self, urls: list[str]) -> None:
        """The weight transport follows a changed fleet (engines replaced, added or removed)."""
        self._all("reconnect_engines", [urls] * len(self.actors))

    def push_full(self, urls: list[str], version: int) -> dict[str, float]:
        """Bring new engines to `version`: a full push over their own transport, noise-fill verified."""
        return self._all("push_full", [urls] * len(self.actors), [version] * len(self.actors))[0]

    def channels(self) -> dict[str, str]:
        """How weights reach each engine URL (the source rank's transport; see WeightUpdater.channels)."""
        return self._ray.get(self.actors[0].channels.remote())

    def pids(self) -> list[int]:
        return self._ray.get([a.pid.remote() for a in self.actors])

    def relabel_engines(self, version: int) -> None:
        """Label the engines' weights as `version` without moving them (before going back to a checkpoint)."""
        self._all("relabel_engines", [version] * len(self.actors))

    def damage_next_delta(self) -> bool:
        """Fault injection: the next disk delta the source rank writes is damaged before any engine reads
        it (see TrainerShell.damage_next_delta); False when weights do not travel as disk deltas."""
        return self._ray.get(self.actors[0].damage_next_delta.remote())

    def stall_next_commit(self, pid: int) -> bool:
        """Fault injection: the source rank's next commit round SIGSTOPs process `pid` (an engine) right
        before its commit (see TrainerShell.stall_next_commit); False when engines have no staged commit."""
        return self._ray.get(self.actors[0].stall_next_commit.remote(pid))

    def sync_weights(self, version: int) -> dict[str, float]:
        metrics = dict(self._all("sync_weights", [version] * len(self.actors))[0])
        if self.cfg.lora.rank:
            # Which weights travelled: merged full weights (1) or the adapters alone (0).
            metrics["sync/lora_merged"] = 1.0 if self.cfg.lora.sync == "merged" else 0.0
        return metrics

    def save_hf(self, out_dir: str, background: bool = False) -> str:
        """Export a Hugging Face checkpoint; with `background` the call returns once the weights are
        gathered and copied, and the write goes on (`checkpoint_written` waits for it)."""
        n = len(self.actors)
        return self._all("save_hf", [out_dir] * n, [background] * n)[0]

    def greedy_accuracy(self, seqs) -> float:
        """Fraction of demonstrations whose answer greedy decoding reproduces (teacher-forced argmax)."""
        hits = self._call_trainer("greedy_matches", seqs)
        return sum(hits) / max(1, len(hits))

    def save_checkpoint(self, path: str, background: bool = False) -> None:
        """Collective distributed checkpoint of the trainer state into `path` (a staging folder); with
        `background` the call returns once every rank has copied its state, and the writes go on."""
        n = len(self.actors)
        self._all("save_checkpoint", [path] * n, [background] * n)

    def checkpoint_written(self) -> None:
        """Wait until every rank's background writes are on disk. Safe to call while the loop drives
        the group: it runs on each rank's checkpoint thread. Raises TrainerFailure if a rank died
        or a write failed."""
        refs = [a.checkpoint_written.options(concurrency_group="checkpoint").remote() for a in self.actors]
        self._gather("checkpoint_written", refs, settles=False)

    def load_checkpoint(self, path: str) -> None:
        self._call_trainer("load_checkpoint", path)

    def _call_trainer(self, method: str, *args):
        n = len(self.actors)
        return self._ray.get([a.call_trainer.remote(method, *args) for a in self.actors])[0] if n else None

    def close(self) -> None:
        if self.closed:  # a restarted run closes the failed group early, and the driver again at exit
            return
        self.closed = True
        if not self.failed:
            # After a failure some ranks may sit in a collective until its timeout: do not wait on them.
            try:
                self._all("close")
            except TrainerFailure:
                pass
        for a in self.actors:
            self._ray.kill(a)


class TrainerFailure(RuntimeError):
    """A trainer rank failed (died, or a collective timed out); the step did not complete."""


def _first_line(exc: BaseException) -> str:
    # Ray wraps the rank's own exception; its cause carries the message worth showing.
    cause = getattr(exc, "cause", None)
    if isinstance(cause, CollectiveTimeout):
        return str(cause)
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "CollectiveTimeout" in line or "died" in line.lower() or "Error" in line:
            return line.strip()[:500]
    return (lines[-1] if lines else type(exc).__name__)[:500]
