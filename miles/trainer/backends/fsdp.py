"""FSDP2 trainer: one instance per rank, all ranks in one torch.distributed group.

Each decoder layer and the root module are sharded with `fully_shard` (with more than one rank;
a single rank trains the plain module); the optimizer steps on the local shards. A step's loss is a weighted sum of per-token losses whose weights depend only on
counts over the *global* batch (`BatchTotals`), so the gradient is the same whether the samples sit
on one rank or many, in one micro-batch or ten, padded or packed.

Around the policy: an optional reference model (KL), an optional value model (PPO), LoRA adapters,
an LR schedule, optimizer-state offload and distributed checkpoints (see the sibling modules).
Tensor/expert parallel layouts come from transformers' distributed config (trainer/parallel.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

from miles.trainer.algorithms.base import AlgorithmConfig
from miles.trainer.lora import LoraConfig


@dataclass
class TrainerConfig:
    num_ranks: int = 1
    """Ranks (processes) of the trainer; data-parallel size is num_ranks / tensor_parallel_size."""
    lr: float = 1e-4
    """AdamW peak learning rate."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the learning rate after warm-up: constant, or linear/cosine decay over lr_decay_steps."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    lr_decay_steps: int = 0
    """Optimizer steps over which linear/cosine schedules decay to min_lr_ratio × lr."""
    min_lr_ratio: float = 0.0
    """Floor of a decaying schedule, as a fraction of lr."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    micro_batch_size: int = 64
    """Most sequences per padded micro-batch on one rank; gradients accumulate across micro-batches."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one micro-batch (padded: rows × longest row; packed: total length). 0 = none."""
    pack_sequences: bool = False
    """Pack sequences end to end into one row per micro-batch (no attention across sequences)."""
    ref_update_every: int = 0
    """Refresh the reference model from the policy every this many steps (0 = keep the initial one)."""
    routing_replay: bool = False
    """Rollout Routing Replay (R3, MoE models): the policy forward routes each token to the experts the
    engine chose (needs rollout.return_routed_experts); gate weights still come from the trainer's router."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks per model replica (DTensor, transformers' TP plan)."""
    expert_parallel_size: int = 1
    """Expert-parallel ranks per model replica for MoE models (DTensor, transformers' EP plan)."""
    offload_optimizer: Literal["none", "cpu", "disk"] = "none"
    """Keep optimizer state off the accelerator between steps: in CPU memory or in files on disk."""
    offload_dir: str = ""
    """Folder for disk offload (empty = a temporary folder per rank)."""
    offload_bucket_mb: int = 64
    """Optimizer state streamed back per bucket of parameters of about this size around the step."""
    num_threads: int = 1
    """torch threads per trainer process (keep at 1 when processes share few cores)."""
    collective_timeout_s: float = 600.0
    """A collective (all-gather, all-reduce) waiting longer than this fails the step with a clear error
    instead of hanging on a dead or stalled rank."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm and its knobs."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (rank 0 = full fine-tuning)."""

    def validate(self) -> None:
        from miles.config import ConfigError

        if self.num_ranks < 1:
            raise ConfigError("trainer.num_ranks must be >= 1")
        if self.collective_timeout_s <= 0:
            raise ConfigError("trainer.collective_timeout_s must be > 0")
        if self.lr <= 0:
            raise ConfigError("trainer.lr must be > 0")
        if self.micro_batch_size < 1 or self.max_tokens_per_micro_batch < 0:
            raise ConfigError("trainer.micro_batch_size must be >= 1 and trainer.max_tokens_per_micro_batch >= 0")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ConfigError("trainer.lr_schedule must be constant, linear or cosine")
        if self.lr_schedule != "constant" and self.lr_decay_steps < 1:
            raise ConfigError(f"trainer.lr_schedule = {self.lr_schedule!r} needs trainer.lr_decay_steps >= 1")
        if self.lr_warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1 or self.ref_update_every < 0:
            raise ConfigError("trainer.lr_warmup_steps >= 0, 0 <= trainer.min_lr_ratio <= 1 and "
                              "trainer.ref_update_every >= 0 are required")
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if tp < 1 or ep < 1 or self.num_ranks % max(tp, ep):
            raise ConfigError(f"trainer.num_ranks ({self.num_ranks}) must be a multiple of "
                              f"tensor_parallel_size ({tp}) and expert_parallel_size ({ep})")
        if self.offload_optimizer not in ("none", "cpu", "disk") or self.offload_bucket_mb < 1:
            raise ConfigError("trainer.offload_optimizer must be none, cpu or disk, and offload_bucket_mb >= 1")
        from miles.trainer.algorithms import ALGORITHMS

        if self.algorithm.name not in ALGORITHMS:
            raise ConfigError(f"trainer.algorithm.name {self.algorithm.name!r} is unknown: "
                              f"choose one of {sorted(ALGORITHMS)}")
        if ALGORITHMS[self.algorithm.name].needs_critic and self.pack_sequences:
            raise ConfigError("PPO's GAE runs along unpacked rows: set trainer.pack_sequences = false "
                              "with trainer.algorithm.name = 'ppo'")
        if self.lora.rank and (tp > 1 or ep > 1):
            raise ConfigError("LoRA with tensor/expert parallelism is not supported: set trainer.lora.rank = 0 "
                              "or tensor_parallel_size = expert_parallel_size = 1")


def lr_lambda(cfg: TrainerConfig):
    """Multiplier of the peak lr at optimizer step `s` (0-based)."""
    import math

    def f(s: int) -> float:
        if s < cfg.lr_warmup_steps:
            return (s + 1) / (cfg.lr_warmup_steps + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        p = min(1.0, (s - cfg.lr_warmup_steps) / cfg.lr_decay_steps)
        shape = 1.0 - p if cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape
    return f


class FSDPTrainer:
    def __init__(self, cfg: TrainerConfig, model_path: str, rank: int, world_size: int,
                 master_addr: str, master_port: int, seed: int = 0, temperature: float = 1.0):
        import torch
        import torch.distributed as dist

        from miles.models.loading import load_tokenizer
        from miles.trainer.algorithms import get_algorithm

        torch.set_num_threads(cfg.num_threads)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if not dist.is_initialized():
            import datetime

            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.model_path, self.temperature = model_path, temperature
        self.step = 0
        torch.manual_seed(seed)
        self.pad_id = load_tokenizer(model_path).pad_token_id or 0
        self.algorithm = get_algorithm(cfg.algorithm)
        self.model, self.dp_size = self._build_policy()
        from miles.models.moe import moe_shape, routers

        self.routers = routers(self.model)  # empty for dense models
        self.moe_shape = moe_shape(self.model.config) if self.routers else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        from miles.trainer.offload import OptimizerSet

        self.optim = OptimizerSet(params, cfg, lr_lambda(cfg), rank)
        self.reference = None
        if cfg.algorithm.kl_coef > 0:
            from miles.trainer.reference import ReferenceModel

            self.reference = ReferenceModel(model_path)
        self.critic = self.critic_optim = None
        if self.algorithm.needs_critic:
            self._build_critic()

    # -- construction ---------------------------------------------------------------------------
    def _build_policy(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from miles.models.loading import load_model

        cfg = self.cfg
        if cfg.tensor_parallel_size > 1 or cfg.expert_parallel_size > 1:
            from miles.trainer.parallel import load_parallel_model

            model, dp = load_parallel_model(self.model_path, cfg.tensor_parallel_size, cfg.expert_parallel_size,
                                            self.world_size)
            model.train()
            return model, dp
        model = load_model(self.model_path, "float32")
        if cfg.lora.rank:
            from miles.trainer.lora import apply_lora

            model = apply_lora(model, cfg.lora)
        if self.world_size > 1:
            # One rank has nothing to shard: FSDP's hooks and DTensor dispatch would be pure cost.
            mesh = init_device_mesh("cpu", (self.world_size,))
            for layer in _decoder_layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        model.train()
        return model, self.world_size

    def _build_critic(self):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForTokenClassification

        critic = AutoModelForTokenClassification.from_pretrained(self.model_path, num_labels=1, dtype=torch.float32,
                                                                 attn_implementation="sdpa")
        torch.nn.init.zeros_(critic.score.weight)  # start from V = 0 rather than random values
        if self.world_size > 1:
            mesh = init_device_mesh("cpu", (self.world_size,))
            for layer in _decoder_layers(critic):
                fully_shard(layer, mesh=mesh)
            fully_shard(critic, mesh=mesh)
        critic.train()
        self.critic = critic
        self.critic_optim = torch.optim.AdamW(critic.parameters(), lr=self.cfg.algorithm.critic_lr,
                                              betas=(self.cfg.adam_beta1, self.cfg.adam_beta2))

    # -- one optimizer step -------------------------------------------------------------------
    def train_step(self, seqs, totals, kind: str = "rl") -> dict[str, float]:
        """Forward/backward over local micro-batches, then one optimizer step (all ranks call this).

        `totals` (BatchTotals, or the global loss-token count) describes the whole global batch.
        """
        out = self.compute_gradients(seqs, totals, kind)
        t_opt = time.perf_counter()
        out[f"{'train' if kind == 'rl' else 'sft'}/grad_norm"] = self._clip_and_step()
        out["perf/train_optimizer_s"] = time.perf_counter() - t_opt
        return out

    def compute_gradients(self, seqs, totals, kind: str = "rl") -> dict[str, float]:
        """Accumulate this rank's share of the step's gradient into .grad (collective); no step."""
        import torch
        import torch.distributed as dist

        from miles.trainer.algorithms.base import token_weights
        from miles.trainer.batching import build_micro_batch, plan_micro_batches
        from miles.trainer.types import BatchTotals

        if isinstance(totals, int):
            totals = BatchTotals(loss_tokens=totals, num_seqs=len(seqs), max_response_len=0)
        algorithm = self.algorithm if kind == "rl" else _sft_algorithm()
        cfg = self.cfg
        if kind == "rl" and cfg.routing_replay:
            from miles.trainer.r3 import check_sequences

            check_sequences(seqs)
        agg = algorithm.loss_agg
        const = cfg.algorithm.loss_constant or totals.max_response_len
        weights = token_weights(agg, [s.num_loss_tokens for s in seqs], totals.loss_tokens, totals.num_seqs, const)
        # Gradients are averaged over data-parallel replicas; scale each replica's sum back up.
        weights = [w * self.dp_size for w in weights]
        plan = plan_micro_batches([len(s.tokens) for s in seqs], cfg.max_tokens_per_micro_batch,
                                  cfg.micro_batch_size, cfg.pack_sequences)
        # Every rank must run the same number of forward/backward passes (FSDP collectives).
        n_mb = torch.tensor([len(plan)])
        dist.all_reduce(n_mb, op=dist.ReduceOp.MAX)
        plan += [[]] * (int(n_mb) - len(plan))

        self._maybe_refresh_reference()
        sums: dict[str, float] = {}
        if self.moe_shape is not None:
            sums.update(r3_pairs=0.0, r3_mismatch=0.0)  # same keys on every rank for the all-reduce below
        self._fwd_bwd_s = [0.0, 0.0]  # this rank's forward / backward seconds, for the step-time breakdown
        for members in plan:
            if members:
                chunk, w = [seqs[i] for i in members], [weights[i] for i in members]
            else:
                # A rank with nothing left still joins the collectives, with zero weight.
                chunk, w = [_placeholder(self.pad_id)], [0.0]
            mb = build_micro_batch(chunk, w, cfg.pack_sequences, self.pad_id, self.moe_shape)
            self._micro_step(mb, algorithm, kind, sums, bool(members))
        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(vec)
        # Replicas of one data shard (tensor-parallel peers) counted the same tokens.
        red = dict(zip(keys, (vec / (self.world_size // self.dp_size)).tolist()))
        n = max(red.get("tokens", 0.0), 1.0)
        prefix = "train" if kind == "rl" else "sft"
        out = {f"{prefix}/loss": red.get("loss", 0.0),
               f"{prefix}/loss_tokens": red.get("tokens", 0.0), f"{prefix}/nll": red.get("nll", 0.0) / n,
               f"{prefix}/lr": self.optim.last_lr}
        if kind == "rl":
            out["train/clipfrac"] = red.get("clipped", 0.0) / n
            out["train/rollout_logprob_abs_diff"] = red.get("logp_diff", 0.0) / n
            if red.get("r3_pairs"):
                out["train/r3_mismatch_rate"] = red["r3_mismatch"] / red["r3_pairs"]
            for k in ("kl", "entropy", "value_loss", "value_mean"):
                if k in red:
                    out[f"train/{k}"] = red[k] / n
            from miles.trainer.algorithms.tis import tis_metrics

            out.update(tis_metrics(red, n))
        out["perf/train_forward_s"], out["perf/train_backward_s"] = self._fwd_bwd_s
        return out

    def _micro_step(self, mb, algorithm, kind: str, sums: dict, real: bool) -> None:
        import torch

        from miles.trainer.algorithms.base import LossInputs, kl_estimate, kl_reward_penalty
        from miles.trainer.forward import forward_logprobs
        from miles.trainer.r3 import routing_replay

        t_fwd = time.perf_counter()
        acfg = self.cfg.algorithm
        temperature = self.temperature if kind == "rl" else 1.0
        want_entropy = kind == "rl" and acfg.entropy_coef > 0
        # Mismatch is counted on real micro-batches only; a placeholder carries no routed experts.
        with routing_replay(self.routers, mb.routed, self.cfg.routing_replay, sums):
            logp, entropy = forward_logprobs(self.model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                             temperature, want_entropy)  # (B, T-1)
        x = LossInputs(logp, mb.old_logprobs, mb.advantages, mb.mask, mb.seq_ids, entropy=entropy)
        extra_loss = 0.0
        if kind == "rl" and self.reference is not None:
            x.ref_logprobs = self.reference.logprobs(mb.input_ids, mb.attention_mask, mb.position_ids, temperature)
            if acfg.kl_mode == "reward":
                x.advantages = kl_reward_penalty(x.advantages, logp.detach(), x.ref_logprobs, mb.mask, mb.seq_ids,
                                                 acfg.kl_coef)
        if kind == "rl" and self.critic is not None:
            extra_loss = self._critic_and_gae(mb, x, sums)
        tis = None
        if kind == "rl" and acfg.tis_mode != "off":
            from miles.trainer.algorithms.tis import corrected_inputs

            x, *tis = corrected_inputs(x, acfg.tis_mode, acfg.tis_clip_low, acfg.tis_clip_high)
        tok_loss, metrics = algorithm.token_loss(x)
        if tis is not None:
            tok_loss = tok_loss * tis[0]
        if kind == "rl" and x.ref_logprobs is not None:
            kl = kl_estimate(logp, x.ref_logprobs, acfg.kl_estimator)
            if acfg.kl_mode == "loss":
                tok_loss = tok_loss + acfg.kl_coef * kl
            _acc(sums, "kl", (kl.detach() * mb.mask).sum())
        if entropy is not None:
            tok_loss = tok_loss - acfg.entropy_coef * entropy
            _acc(sums, "entropy", (entropy.detach() * mb.mask).sum())
        loss = (tok_loss * mb.weights).sum() + extra_loss
        t_bwd = time.perf_counter()
        loss.backward()
        self._fwd_bwd_s[0] += t_bwd - t_fwd
        self._fwd_bwd_s[1] += time.perf_counter() - t_bwd
        if not real:
            return
        with torch.no_grad():
            # The reported loss is the aggregated one: undo the data-parallel scale-up.
            _acc(sums, "loss", (tok_loss * mb.weights).sum() / self.dp_size)
            _acc(sums, "tokens", mb.mask.sum())
            _acc(sums, "nll", (-logp * mb.mask).sum())
            if "clipfrac" in metrics:
                _acc(sums, "clipped", (metrics["clipfrac"] * mb.mask).sum())
            if kind == "rl":
                _acc(sums, "logp_diff", ((logp - mb.old_logprobs).abs() * mb.mask).sum())
            if tis is not None:
                from miles.trainer.algorithms.tis import tis_sums

                for k, v in tis_sums(tis[0], tis[1], logp, mb.old_logprobs, mb.mask).items():
                    _acc(sums, k, v)

    def _critic_and_gae(self, mb, x, sums) -> "object":
        """PPO: values from the critic, GAE advantages into `x`, and the critic's weighted loss."""
        import torch

        from miles.trainer.algorithms.ppo import gae, value_loss

        acfg = self.cfg.algorithm
        out = self.critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        values = out.logits[:, :-1, 0].float()  # (B, T-1): value of the state before each next token
        # The sequence's reward sits on its last loss token; every other token's reward is 0 (or -KL).
        rewards = torch.zeros_like(values)
        for b in range(mb.mask.shape[0]):
            pos = mb.mask[b].nonzero().flatten()
            if len(pos):
                rewards[b, pos[-1]] = mb.advantages[b, pos[-1]]
        old_values = values.detach()
        adv, returns = gae(rewards, old_values, mb.mask, acfg.gamma, acfg.gae_lambda)
        if x.ref_logprobs is not None and acfg.kl_mode == "reward":
            # The KL penalty was folded into `x.advantages`; keep that part on top of GAE.
            adv = adv + (x.advantages - mb.advantages) * mb.mask
        x.advantages = adv
        v_loss = value_loss(values, old_values, returns, acfg.value_clip)
        _acc(sums, "value_loss", (v_loss.detach() * mb.mask).sum())
        _acc(sums, "value_mean", (old_values * mb.mask).sum())
        return (v_loss * mb.weights).sum()

    def _clip_and_step(self) -> float:
        norm = clip_grad_norm([p for p in self.model.parameters() if p.grad is not None], self.cfg.grad_clip)
        self.optim.step()
        self.optim.zero_grad()
        if self.critic is not None:
            clip_grad_norm([p for p in self.critic.parameters() if p.grad is not None], self.cfg.grad_clip)
            self.critic_optim.step()
            self.critic_optim.zero_grad(set_to_none=True)
        self.step += 1
        return float(norm)

    def _maybe_refresh_reference(self) -> None:
        every = self.cfg.ref_update_every
        if self.reference is not None and every and self.step and self.step % every == 0 \
                and self.reference.version != self.step:
            self.reference.load(self.full_named_tensors(all_ranks=True, merged=True), self.step)

    # -- weights out ----------------------------------------------------------------------------
    def full_named_tensors(self, all_ranks: bool = False, merged: bool | None = None) -> Iterator[tuple[str, "object"]]:
        """Full (unsharded) tensors by HF name. Collective: every rank must iterate to the end;
        only rank 0 receives tensors unless `all_ranks` (other ranks get None).

        With LoRA, `merged` (default: lora.sync = "merged") folds adapters into the base weights;
        otherwise only the adapter tensors are yielded, under PEFT's names."""
        named = self._raw_full_tensors(all_ranks)
        if not self.cfg.lora.rank:
            yield from named
            return
        from miles.trainer.lora import adapter_tensors, merged_tensors

        if merged is None:
            merged = self.cfg.lora.sync == "merged"
        yield from (merged_tensors(named, self.cfg.lora) if merged else adapter_tensors(named))

    def _raw_full_tensors(self, all_ranks: bool):
        seen: dict[int, str] = {}
        for name, value in self.model.state_dict().items():
            local = value.to_local() if hasattr(value, "to_local") else value
            key = local.untyped_storage().data_ptr() if local.numel() else id(value)
            if key in seen:  # tied weights (embeddings/lm_head) travel once
                continue
            seen[key] = name
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            yield name, (full.detach() if (self.rank == 0 or all_ranks) else None)

    def save_hf(self, out_dir: str) -> str | None:
        """Export a Hugging Face checkpoint directory (loadable by from_pretrained). Collective.
        LoRA runs export the merged model."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from miles.models.loading import load_tokenizer

        state = {n: t.clone() for n, t in self.full_named_tensors(merged=True) if t is not None}
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

    # -- resumable state ------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Distributed checkpoint of everything the next step depends on. Collective."""
        from miles.trainer.checkpoint import save_trainer_state

        save_trainer_state(self, path)

    def load_checkpoint(self, path: str) -> None:
        from miles.trainer.checkpoint import load_trainer_state

        load_trainer_state(self, path)


def clip_grad_norm(params, max_norm: float) -> float:
    """Global L2 norm of the gradients, clipped to max_norm (0 = measure only).

    Under tensor/expert parallelism gradients are DTensors on different meshes and placements next
    to plain tensors, which torch's clip_grad_norm_ cannot mix; each kind is measured on its own
    and the squares summed."""
    import math

    import torch

    groups: dict[object, list] = {}
    for p in params:
        g = p.grad
        key = (id(g.device_mesh), tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(p)
    sq = 0.0
    for group in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        if hasattr(n, "full_tensor"):
            n = n.full_tensor()
        sq += float(n) ** 2
    total = math.sqrt(sq)
    if max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        with torch.no_grad():
            for group in groups.values():
                for p in group:
                    p.grad.mul_(coef)
    return total


def _decoder_layers(model):
    """The decoder blocks of an HF causal LM (or a PEFT wrapper / token classifier around one)."""
    for name, module in model.named_modules():
        if name.endswith("layers") and hasattr(module, "__len__") and len(module) and \
                type(module).__name__ == "ModuleList":
            return list(module)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def _acc(sums: dict, key: str, value) -> None:
    sums[key] = sums.get(key, 0.0) + float(value)


_SFT = None


def _sft_algorithm():
    global _SFT
    if _SFT is None:
        from miles.trainer.algorithms import get_algorithm
        from miles.trainer.algorithms.base import AlgorithmConfig

        _SFT = get_algorithm(AlgorithmConfig(name="sft"))
    return _SFT


def _placeholder(pad_id: int):
    from miles.trainer.types import TrainSequence

    return TrainSequence(tokens=[pad_id, pad_id], prompt_len=1, loss_mask=[0], old_logprobs=[0.0])
