"""The Megatron backend's resumable state: per-rank shards of its own layout, and a layout-free copy.

Each rank writes its own shard of the models and optimizer (megatron-core's state dicts, as this
layout holds them) into its rank file; the DCP part holds only the update count, so the commit
protocol (trainer/checkpoint.py: DCP metadata, then every rank's file) marks the write complete.
Rank 0's file also holds the layout-free copy: the weights and both Adam moments gathered under
Hugging Face names (the moments are laid out like their weights, so the same permutations carry
them). A run at the saved layout resumes from its own shards bit for bit; a run at another layout
(TP 2 → TP 1, another EP or PP) takes its shards of the layout-free copy. The gather costs what
an export costs, once per checkpoint.
Non-goal: the commit protocol itself (trainer/checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from miles.trainer.checkpoint import CheckpointWriter, fsync_write, host_copy
from miles.trainer.device import HOST


class ResumableState:
    """save_state / load_state of MegatronBackend (backend.py), which holds the chunks, the optimizer,
    the update count and the HF conversions these use."""

    def save_state(self, path: str, writer: CheckpointWriter, local: dict) -> None:
        group = writer.group
        shard = host_copy({"chunks": [c.state_dict() for c in self.chunks], "optim": self.optimizer.state_dict()})
        portable = self._portable_state()
        local = {**local, "megatron": shard, "updates": self._updates, "layout": self._layout()}
        if self.rank == 0:
            local["portable"] = portable
        writer.submit(_write_state, {f"rank{self.rank}_updates": torch.tensor(self._updates)}, local,
                      Path(path), self.rank, group)

    def _adam(self) -> dict:
        """Each parameter's torch AdamW (megatron-core's FP32Optimizer steps the model's own parameters)."""
        owner = {}
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in opt.optimizer.param_groups:
                owner.update({p: opt.optimizer for p in group["params"]})
        return owner

    def _portable_state(self) -> dict:
        """Weights and Adam moments under HF names, gathered over every layout dimension (collective)."""
        adam = self._adam()
        out = {"weights": {k: v.to(HOST) for k, v in self._all_stages(self._hf_tensors()).items()}}
        stepped = [p for p in adam if adam[p].state.get(p)]
        if dist.get_world_size() > 1:  # every rank must agree on whether the moments exist (collective gathers)
            flag = torch.tensor([int(bool(stepped))], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            stepped = stepped if int(flag) else []
        if stepped:
            for key in ("exp_avg", "exp_avg_sq"):
                moments = self._hf_tensors(lambda p, key=key: adam[p].state[p][key])
                out[key] = {k: v.to(HOST) for k, v in self._all_stages(moments).items()}
            out["adam_step"] = float(adam[stepped[0]].state[stepped[0]]["step"])
        return out

    def load_state(self, path: str) -> dict:
        src = Path(path) / f"rank{self.rank}.pt"
        first = Path(path) / "rank0.pt"
        if not first.exists():
            raise FileNotFoundError(f"{first} is missing: {path} is not a complete checkpoint")
        local = torch.load(src if src.exists() else first, weights_only=False)
        if local.get("layout") != self._layout():
            return self._load_resharded(path, local if src.exists() else None)
        for chunk, sd in zip(self.chunks, local["megatron"]["chunks"]):
            chunk.load_state_dict(sd)
        self.optimizer.load_state_dict(local["megatron"]["optim"])
        self._updates = local["updates"]
        self._set_lr()
        return local

    @torch.no_grad()
    def _load_resharded(self, path: str, local: dict | None) -> dict:
        """Resume a checkpoint written at another layout from rank 0's layout-free copy. The trainer's
        own state (step, RNG) comes from this rank's file, or rank 0's when the saved run had fewer ranks."""
        first = torch.load(Path(path) / "rank0.pt", weights_only=False)
        portable = first.get("portable")
        if portable is None:
            raise ValueError(f"{path} was written at layout {first.get('layout')} without a layout-free copy, this "
                             f"run is {self._layout()}: resume with the saved run's parallel sizes")
        self._load_hf(portable["weights"])
        if "exp_avg" in portable:
            adam = self._adam()
            states: dict = {}

            def into(key):
                def put(p, shard):
                    states.setdefault(p, {"step": torch.tensor(portable["adam_step"])})[key] = shard.clone()
                return put
            self._load_hf(portable["exp_avg"], into("exp_avg"))
            self._load_hf(portable["exp_avg_sq"], into("exp_avg_sq"))
            for p, state in states.items():
                adam[p].state[p] = state
        local = local if local is not None else first
        self._updates = local["updates"]
        self._set_lr()
        return local

    def _layout(self) -> dict:
        c = self.cfg
        return {"world": self.world_size, "tp": c.tensor_parallel_size, "pp": c.pipeline_parallel_size,
                "vpp": c.virtual_pipeline_parallel_size, "cp": c.context_parallel_size,
                "ep": c.expert_parallel_size, "etp": c.expert_tensor_parallel_size}


def _write_state(marker: dict, local: dict, out: Path, rank: int, group) -> None:
    import torch.distributed.checkpoint as dcp

    out.mkdir(parents=True, exist_ok=True)
    dcp.save(marker, checkpoint_id=str(out / "dcp"), process_group=group)
    fsync_write(out / f"rank{rank}.pt", lambda f: torch.save(local, f))
