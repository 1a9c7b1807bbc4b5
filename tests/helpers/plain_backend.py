"""A second trainer backend in one file: the whole policy on one rank, plain torch, nothing sharded.

It shows what a backend owns (the Backend protocol of miles/trainer/backends/base.py) and nothing
more: the training step, the algorithms, LoRA naming, exports and checkpoints' bookkeeping come from
the trainer. Selected with `trainer.backend = "tests.helpers.plain_backend:PlainBackend"`, or by a
name once registered in BACKENDS.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from miles.trainer.backends.loading import load_critic, load_policy
from miles.trainer.checkpoint import load_trainer_state, save_trainer_state
from miles.trainer.config import lr_lambda
from miles.trainer.device import HOST, collective_backend, compute_device
from miles.trainer.forward import run_micro_batches
from miles.trainer.offload import OptimizerSet


class PlainBackend:
    def __init__(self, cfg, model_path: str, rank: int, world_size: int, master_addr: str, master_port: int):
        if world_size != 1:
            raise ValueError("the plain backend trains on one rank: set trainer.num_ranks = 1")
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        self.device = compute_device(cfg.device, rank)
        if not dist.is_initialized():  # the trainer all-reduces its counts over the default group
            dist.init_process_group(collective_backend(cfg.device, cfg.collective_backend), rank=0, world_size=1)
        self.cfg, self.rank, self.world_size, self.dp_size, self.loss_copies = cfg, rank, 1, 1, 1
        self.model_path = model_path
        self.model = load_policy(cfg, model_path, self.device)
        self.model.train()
        self.optim = OptimizerSet([p for p in self.model.parameters() if p.requires_grad], cfg, lr_lambda(cfg), rank)
        self.critic = self.critic_optim = None
        self.steps = 0  # optimizer steps taken, for the test to see this backend did the stepping

    @property
    def last_lr(self) -> float:
        return self.optim.last_lr

    def build_critic(self, lr: float) -> None:
        self.critic = load_critic(self.model_path, self.device)
        self.critic.train()
        self.critic_optim = torch.optim.AdamW(self.critic.parameters(), lr=lr,
                                              betas=(self.cfg.adam_beta1, self.cfg.adam_beta2))

    def forward_backward(self, micro_batches, loss_fn, request, forward_only=False, around_forward=None):
        return run_micro_batches(self._logits, lambda loss: loss.backward(), micro_batches, loss_fn, request,
                                 forward_only, around_forward)

    def _logits(self, mb) -> torch.Tensor:
        with mb.images.spliced_into(self.model) if mb.images is not None else contextlib.nullcontext():
            return self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                              use_cache=False).logits

    def critic_values(self, input_ids, attention_mask) -> torch.Tensor:
        out = self.critic(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits[:, :-1, 0].float()

    def optimizer_step(self) -> float:
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], clip)
        self.optim.step()
        self.optim.zero_grad()
        if self.critic is not None:
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), clip)
            self.critic_optim.step()
            self.critic_optim.zero_grad(set_to_none=True)
        self.steps += 1
        return float(norm)

    def named_tensors(self, all_ranks: bool = False, on_device: bool = False):
        seen: set[int] = set()
        for name, value in self.model.state_dict().items():
            if value.untyped_storage().data_ptr() in seen:  # tied weights travel once
                continue
            seen.add(value.untyped_storage().data_ptr())
            yield name, value.detach() if on_device else value.detach().to(HOST)

    def save_state(self, path: str, writer, local: dict) -> None:
        save_trainer_state(self, path, writer, local)

    def load_state(self, path: str) -> dict:
        return load_trainer_state(self, path)
