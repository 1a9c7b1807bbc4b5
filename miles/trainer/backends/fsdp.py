"""FSDP2 backend: one instance per rank, all ranks in one torch.distributed group.

Each decoder layer and the root module are sharded with `fully_shard` when there is more than one
rank; the optimizer steps on the local shards. With `trainer.param_dtype = "bfloat16"` FSDP2's
MixedPrecisionPolicy casts the float32 shards to bfloat16 for the forward and backward and reduces
gradients in float32. A single rank trains the plain module: in float32 as it is, in bfloat16 through
compute copies of its float32 master weights (compute_copy.py: FSDP2's numerics without its cost). Tensor/expert
parallel layouts come from transformers' distributed config (trainer/parallel.py), as DTensors, with
FSDP over the data-parallel replicas. Full weights leave as DTensors gathered with `full_tensor`.

What this file does not do is the training step (trainer/trainer.py) and building the unsharded
models (backends/loading.py): it holds only what is FSDP's. The contract is backends/base.py.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from miles.trainer.backends.compute_copy import ComputeCopy
from miles.trainer.backends.loading import load_critic, load_policy
from miles.trainer.checkpoint import CheckpointWriter, load_trainer_state, save_trainer_state
from miles.trainer.config import TrainerConfig, lr_lambda
from miles.trainer.device import HOST, join_trainer_group, mixed_precision, param_dtype
from miles.trainer.forward import run_micro_batches, shared_prompt_logits, shares_prompt_kv
from miles.trainer.offload import OptimizerSet
from miles.trainer import packed_attention
from miles.trainer.parallel import load_parallel_model


class FSDPBackend:
    """The policy (and critic) sharded with FSDP2 over every rank of the trainer."""

    def __init__(self, cfg: TrainerConfig, model_path: str, rank: int, world_size: int,
                 master_addr: str, master_port: int):
        self.device = join_trainer_group(cfg, rank, world_size, master_addr, master_port)
        self.cfg, self.rank, self.world_size, self.model_path = cfg, rank, world_size, model_path
        self.compute_copy: ComputeCopy | None = None  # one rank in bfloat16 (see the module docstring)
        self.packs_by_plan = False
        self.model, self.dp_size = self._build_policy()
        self.loss_copies = world_size // self.dp_size  # every rank of a replica computes the whole loss
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optim = OptimizerSet(params, cfg, lr_lambda(cfg), rank)
        self.critic = self.critic_optim = None
        # Rows may continue their prompts' KV (batching.SharedPrompts) on one rank's whole model whose
        # forward keeps that KV (activation checkpointing turns transformers' cache off). Not under FSDP
        # sharding: a gradient reaching a layer through the shared KV rather than through the layer's
        # output would skip the hook that gathers its parameters for the backward.
        self.shares_prompts = world_size == 1 and not cfg.activation_checkpointing and \
            shares_prompt_kv(self.model.config)

    def _build_policy(self):
        cfg = self.cfg
        if cfg.tensor_parallel_size > 1 or cfg.expert_parallel_size > 1:
            model, dp = load_parallel_model(self.model_path, cfg.tensor_parallel_size, cfg.expert_parallel_size,
                                            self.world_size)
            model.train()
            return model, dp
        model = load_policy(cfg, self.model_path, self.device)
        # Packed rows attend a sequence at a time (packed_attention.py) instead of through an N x N mask.
        self.packs_by_plan = cfg.pack_sequences is not False and packed_attention.enable(model)
        if self.world_size == 1 and cfg.param_dtype != "float32":
            self.compute_copy = ComputeCopy(model, param_dtype(cfg.param_dtype))
        else:
            _shard(model, self.world_size, self.device, mixed_precision(cfg.param_dtype))
        model.train()
        return model, self.world_size

    def build_critic(self, lr: float) -> None:
        critic = load_critic(self.model_path, self.device)
        _shard(critic, self.world_size, self.device, mixed_precision(self.cfg.param_dtype))
        critic.train()
        self.critic = critic
        self.critic_optim = torch.optim.AdamW(critic.parameters(), lr=lr,
                                              betas=(self.cfg.adam_beta1, self.cfg.adam_beta2))

    @property
    def last_lr(self) -> float:
        return self.optim.last_lr

    def forward_backward(self, micro_batches, loss_fn, request, forward_only=False, around_forward=None):
        return run_micro_batches(self._logits, self._backward, micro_batches, loss_fn, request, forward_only,
                                 around_forward)

    def _logits(self, mb) -> torch.Tensor:
        if self.compute_copy is not None:
            self.compute_copy.to_compute()
        if mb.shared is not None:
            return shared_prompt_logits(self.model, mb)
        if self.packs_by_plan and mb.packed is not None:
            return packed_attention.logits(self.model, mb.input_ids, mb.position_ids, mb.packed)  # (1, N, V)
        # A vision-language batch's images are spliced in during the forward (trainer/vision.py).
        with mb.images.spliced_into(self.model) if mb.images is not None else contextlib.nullcontext():
            return self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                              use_cache=False).logits  # (B, T, V)

    def critic_values(self, input_ids, attention_mask) -> torch.Tensor:
        out = self.critic(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits[:, :-1, 0].float()  # (B, T-1): value of the state before each next token

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.compute_copy is not None:
            self.compute_copy.accumulate()

    def _master_weights(self) -> None:
        """The parameters hold the float32 master weights (and their gradients) from here on."""
        if self.compute_copy is not None:
            self.compute_copy.to_master()

    def optimizer_step(self) -> float:
        self._master_weights()
        norm = clip_grad_norm([p for p in self.model.parameters() if p.grad is not None], self.cfg.grad_clip)
        self.optim.step()
        self.optim.zero_grad()
        if self.critic is not None:
            clip_grad_norm([p for p in self.critic.parameters() if p.grad is not None], self.cfg.grad_clip)
            self.critic_optim.step()
            self.critic_optim.zero_grad(set_to_none=True)
        return float(norm)

    def named_tensors(self, all_ranks: bool = False,
                      on_device: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
        self._master_weights()
        seen: dict[int, str] = {}
        for name, value in self.model.state_dict().items():
            local = value.to_local() if hasattr(value, "to_local") else value
            key = local.untyped_storage().data_ptr() if local.numel() else id(value)
            if key in seen:  # tied weights (embeddings/lm_head) travel once
                continue
            seen[key] = name
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            # Weights leave through host memory, which every transport reads (a no-op on a CPU trainer),
            # unless the transport takes them where the trainer computes.
            yield name, ((full.detach() if on_device else full.detach().to(HOST)) if (self.rank == 0 or all_ranks)
                         else None)

    def save_state(self, path: str, writer: CheckpointWriter, local: dict) -> None:
        self._master_weights()
        save_trainer_state(self, path, writer, local)

    def load_state(self, path: str) -> dict:
        self._master_weights()
        return load_trainer_state(self, path)


def clip_grad_norm(params, max_norm: float) -> float:
    """Global L2 norm of the gradients, clipped to max_norm (0 = measure only).

    Under tensor/expert parallelism gradients are DTensors on different meshes and placements next
    to plain tensors, which torch's clip_grad_norm_ cannot mix; each kind is measured on its own
    and the squares summed."""

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


def _shard(model, world_size: int, device: torch.device, mp_policy=None) -> None:
    """FSDP2 over all ranks: each decoder layer, then the root module (one rank in float32: nothing to do;
    the policy's single bfloat16 rank uses compute copies instead, a critic's is sharded for the cast)."""
    if world_size <= 1 and mp_policy is None:
        return  # one rank has nothing to shard: FSDP's hooks and DTensor dispatch would be pure cost
    mesh = init_device_mesh(device.type, (world_size,))
    kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def _decoder_layers(model):
    """The decoder blocks of an HF causal LM (or a PEFT wrapper / token classifier around one)."""
    for name, module in model.named_modules():
        if name.endswith("layers") and hasattr(module, "__len__") and len(module) and \
                type(module).__name__ == "ModuleList":
            return list(module)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
