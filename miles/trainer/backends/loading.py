"""The models a backend trains, as they are before it lays them out over ranks.

The policy: float32 master weights whatever the compute dtype, its Linear layers computing in
`trainer.quantization`'s format when set (quantization-aware training, precision/linear.py; applied
before any sharding), LoRA adapters when `trainer.lora.rank` > 0, activation checkpointing per decoder
layer when `trainer.activation_checkpointing`. The value model (PPO): the same
checkpoint as a one-label token classifier whose head starts at zero, so V = 0 rather than random.
Both end on the backend's device. Non-goal: sharding, parallel layouts, optimizers (the backend's).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForTokenClassification

from miles.models.loading import attention_implementation, load_model
from miles.precision.linear import quantize_linears
from miles.trainer.config import TrainerConfig
from miles.trainer.lora import apply_lora


def load_policy(cfg: TrainerConfig, model_path: str, device: torch.device) -> torch.nn.Module:
    """The policy to train, whole, on `device`. A vision-language policy's vision tower is frozen
    unless trainer.train_vision_tower."""
    model = load_model(model_path, "float32")
    visual = getattr(getattr(model, "model", None), "visual", None)
    if visual is not None:
        if cfg.quantization != "none" or cfg.lora.rank:
            raise ValueError("trainer: quantization-aware training and LoRA are not supported for a "
                             "vision-language policy: set trainer.quantization = 'none' and trainer.lora.rank = 0")
        for p in visual.parameters():
            p.requires_grad_(cfg.train_vision_tower)
    quantize_linears(model, cfg.quantization, "train", key="trainer.quantization",  # before sharding
                     embeddings=cfg.quantize_embeddings)
    if cfg.lora.rank:
        model = apply_lora(model, cfg.lora)
    if cfg.activation_checkpointing:
        # Non-reentrant: it needs no input that requires grad (LoRA freezes the embeddings) and works under FSDP2.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    return model


def load_critic(model_path: str, device: torch.device) -> torch.nn.Module:
    """A value model from the policy's checkpoint, whole, on `device`, predicting 0 everywhere."""
    critic = AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32,
                                                             attn_implementation=attention_implementation(model_path))
    torch.nn.init.zeros_(critic.score.weight)  # start from V = 0 rather than random values
    critic.to(device)
    return critic
