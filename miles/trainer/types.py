"""What the trainer consumes: token sequences with per-token training targets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainSequence:
    tokens: list[int]            # prompt + response, as generated (TITO)
    prompt_len: int
    loss_mask: list[int]         # per response token
    old_logprobs: list[float]    # per response token; the behaviour policy's (rollout) logprobs
    advantage: float = 0.0

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)
