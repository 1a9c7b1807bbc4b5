"""FSDP2 trainer: one instance per rank, all ranks in one torch.distributed group.

Each decoder layer and the root module are sharded with `fully_shard`; the optimizer steps on the
local shards. The loss of a step is normalised by the loss-token count of the *global* batch, so a
step's gradient is the same whether its samples sit on one rank or many, in one micro-batch or ten.
Non-goals here: tensor/expert parallelism and checkpoint resume (later layers of this backend).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from miles.trainer.algorithms.base import AlgorithmConfig


@dataclass
class TrainerConfig:
    num_ranks: int = 1
    """Data-parallel ranks (processes) of the FSDP2 trainer."""
    lr: float = 1e-4
    """AdamW learning rate."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward on one rank; gradients accumulate across micro-batches."""
    num_threads: int = 1
    """torch threads per trainer process (keep at 1 when processes share few cores)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm and its knobs."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.num_ranks < 1:
            raise ConfigError("trainer.num_ranks must be >= 1")
        if self.lr <= 0:
            raise ConfigError("trainer.lr must be > 0")
        if self.micro_batch_size < 1:
            raise ConfigError("trainer.micro_batch_size must be >= 1")
        from miles.trainer.algorithms import ALGORITHMS

        if self.algorithm.name not in ALGORITHMS:
            raise ConfigError(f"trainer.algorithm.name {self.algorithm.name!r} is unknown: "
                              f"choose one of {sorted(ALGORITHMS)}")


class FSDPTrainer:
    def __init__(self, cfg: TrainerConfig, model_path: str, rank: int, world_size: int,
                 master_addr: str, master_port: int, seed: int = 0, temperature: float = 1.0):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from miles.models.loading import load_model, load_tokenizer

        torch.set_num_threads(cfg.num_threads)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.model_path, self.temperature = model_path, temperature
        torch.manual_seed(seed)
        model = load_model(model_path, "float32")
        self.pad_id = load_tokenizer(model_path).pad_token_id or 0
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.train()
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=(cfg.adam_beta1, cfg.adam_beta2))
        from miles.trainer.algorithms import get_algorithm

        self.algorithm = get_algorithm(cfg.algorithm)

    # -- one optimizer step -------------------------------------------------------------------
    def train_step(self, seqs, global_loss_tokens: int, kind: str = "rl") -> dict[str, float]:
        """Forward/backward over local micro-batches, then one optimizer step (all ranks call this).

        `global_loss_tokens` counts loss tokens across every rank's sequences of this step.
        """
        import torch
        import torch.distributed as dist

        from miles.trainer.forward import pad_batch, token_logprobs

        # FSDP averages gradients over ranks, so each rank's sum is scaled back up by world_size.
        scale = self.world_size / max(global_loss_tokens, 1)
        sums = torch.zeros(5, dtype=torch.float64)  # loss, clipped, |Δlogprob| vs rollout, tokens, -logp
        mbs = self.cfg.micro_batch_size
        for start in range(0, max(len(seqs), 1), mbs):
            chunk = seqs[start:start + mbs]
            if not chunk:
                # A rank with no samples still joins the collectives of forward/backward.
                chunk, weight = [seqs_placeholder(self.pad_id)], 0.0
            else:
                weight = 1.0
            ids, attn = pad_batch([s.tokens for s in chunk], self.pad_id)
            logp = token_logprobs(self.model, ids, attn, self.temperature if kind == "rl" else 1.0)  # (B, T-1)
            mask, old, adv = self._targets(chunk, logp.shape[1])
            mask = mask * weight
            if kind == "sft":
                tok_loss, clipped = -logp, torch.zeros_like(logp)
            else:
                tok_loss, extra = self.algorithm.token_loss(logp, old, adv)
                clipped = extra.get("clipfrac", torch.zeros_like(logp))
            loss = (tok_loss * mask).sum() * scale
            loss.backward()
            with torch.no_grad():
                sums += torch.tensor([
                    (tok_loss * mask).sum().item(), (clipped * mask).sum().item(),
                    ((logp - old).abs() * mask).sum().item() if kind == "rl" else 0.0,
                    mask.sum().item(), (-logp * mask).sum().item()], dtype=torch.float64)
        grad_norm = self._clip_and_step()
        dist.all_reduce(sums)
        n = max(sums[3].item(), 1.0)
        prefix = "train" if kind == "rl" else "sft"
        out = {f"{prefix}/loss": sums[0].item() / n, f"{prefix}/grad_norm": grad_norm,
               f"{prefix}/loss_tokens": sums[3].item(), f"{prefix}/nll": sums[4].item() / n}
        if kind == "rl":
            out["train/clipfrac"] = sums[1].item() / n
            out["train/rollout_logprob_abs_diff"] = sums[2].item() / n
        return out

    def _targets(self, chunk, width: int):
        """Loss mask, old logprobs and advantages aligned to next-token positions. Each (B, T-1)."""
        import torch

        mask = torch.zeros(len(chunk), width)
        old = torch.zeros(len(chunk), width)
        adv = torch.zeros(len(chunk), width)
        for i, s in enumerate(chunk):
            # Response token j sits at position prompt_len + j; it is predicted at position - 1.
            lo = s.prompt_len - 1
            n = len(s.loss_mask)
            mask[i, lo:lo + n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            if s.old_logprobs:
                old[i, lo:lo + n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
            adv[i, lo:lo + n] = s.advantage
        return mask, old, adv

    def _clip_and_step(self) -> float:
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # -- weights out ----------------------------------------------------------------------------
    def full_named_tensors(self) -> Iterator[tuple[str, "object"]]:
        """Full (unsharded) tensors by HF name. Collective: every rank must iterate to the end;
        only rank 0 receives tensors (other ranks get None)."""
        seen: dict[int, str] = {}
        for name, value in self.model.state_dict().items():
            local = value.to_local() if hasattr(value, "to_local") else value
            key = local.untyped_storage().data_ptr() if local.numel() else id(value)
            if key in seen:  # tied weights (embeddings/lm_head) travel once
                continue
            seen[key] = name
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            yield name, (full.detach() if self.rank == 0 else None)

    def save_hf(self, out_dir: str) -> str | None:
        """Export a Hugging Face checkpoint directory (loadable by from_pretrained). Collective."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from miles.models.loading import load_tokenizer

        state = {n: t.clone() for n, t in self.full_named_tensors() if t is not None}
        if self.rank != 0:
            return None
        config = AutoConfig.from_pretrained(self.model_path)
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"export mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if config.tie_word_embeddings:
            model.tie_weights()
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(self.model_path).save_pretrained(tmp)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)  # a checkpoint directory appears whole or not at all
        return str(out)


def seqs_placeholder(pad_id: int):
    from miles.trainer.types import TrainSequence

    return TrainSequence(tokens=[pad_id, pad_id], prompt_len=1, loss_mask=[0], old_logprobs=[0.0])
