"""Supervised warm start: demonstrations → token sequences with the loss on the answer only."""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.loader import ConfigError
from miles.trainer.types import TrainSequence


@dataclass
class SFTConfig:
    steps: int = 200
    """Optimizer steps of supervised training (the most it runs when target_accuracy is set)."""
    batch_size: int = 64
    """Demonstrations per step."""
    lr: float = 1e-3
    """Learning rate for SFT (overrides trainer.lr)."""
    num_examples: int = 4096
    """Distinct demonstrations drawn from the task's train split (cycled through)."""
    out: str = "runs/sft-model"
    """Where the warm-started Hugging Face checkpoint is written."""
    target_accuracy: float = 0.0
    """Stop once greedy accuracy on held-out demonstrations reaches this (0 = run all steps). A warm
    start that ends at a fixed accuracy rather than a fixed step count lands at the same place on
    every machine, whatever the CPU's rounding does to the trajectory."""
    eval_every: int = 25
    """Steps between held-out accuracy checks when target_accuracy is set."""
    eval_examples: int = 256
    """Held-out demonstrations (the task's eval split) the accuracy is measured on."""

    def validate(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.num_examples < 1 or self.lr <= 0:
            raise ConfigError("sft.steps >= 0, sft.batch_size >= 1, sft.num_examples >= 1 and sft.lr > 0 are required")
        if not 0.0 <= self.target_accuracy <= 1.0:
            raise ConfigError(f"sft.target_accuracy must lie in [0, 1] (0 = no early stop), got {self.target_accuracy}")
        if self.eval_every < 1 or self.eval_examples < 1:
            raise ConfigError("sft.eval_every >= 1 and sft.eval_examples >= 1 are required")


def demonstration_sequences(prompts, tokenizer, encode):
    """One TrainSequence per prompt: prompt ids (`encode(prompt)`) + answer ids + EOS, loss on answer and EOS
    (with the prompt's images, for a vision-language model)."""
    seqs = []
    for p in prompts:
        prompt_ids = encode(p)
        answer_ids = tokenizer(p.label, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(TrainSequence(tokens=prompt_ids + answer_ids, prompt_len=len(prompt_ids),
                                  loss_mask=[1] * len(answer_ids), old_logprobs=[], images=getattr(p, "images", ())))
    return seqs
