"""What the trainer consumes: token sequences with per-token training targets, and the global
counts of a step's batch that make its loss independent of how the batch is split."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TrainSequence:
    tokens: list[int]            # prompt + response, as generated (TITO)
    prompt_len: int
    loss_mask: list[int]         # per response token
    old_logprobs: list[float]    # per response token; the behaviour policy's (rollout) logprobs
    advantage: float = 0.0
    token_advantages: list[float] = field(default_factory=list)  # per response token; overrides advantage
    routed_experts: str | None = None  # the engine's expert ids per token (Sample.routed_experts), for R3
    teacher_logprobs: list[float] | None = None  # per response token; a teacher engine's (Sample.teacher_logprobs)
    prox_logprobs: list[float] | None = None  # per response token; the proximal policy's (the weights at the
    # start of a step of several minibatches), recorded by the trainer before its first update
    images: tuple = ()  # a vision-language prompt's PromptImages (Sample.images), in the order of its image tokens

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def response_len(self) -> int:
        return len(self.loss_mask)


@dataclass(frozen=True)
class BatchTotals:
    """Counts over the whole global batch of one optimizer step (every rank, every micro-batch)."""

    loss_tokens: int
    num_seqs: int            # sequences with at least one loss token
    max_response_len: int

    @staticmethod
    def of(seqs: list[TrainSequence]) -> "BatchTotals":
        trained = [s for s in seqs if s.num_loss_tokens > 0]
        return BatchTotals(loss_tokens=sum(s.num_loss_tokens for s in trained), num_seqs=len(trained),
                           max_response_len=max((s.response_len for s in trained), default=0))


@dataclass(frozen=True)
class StepBatch:
    """One step's training data for the whole trainer, before it is split over ranks: consecutive
    minibatches, one optimizer update each, every one with the totals of its own global batch."""

    minibatches: list[tuple[list[TrainSequence], BatchTotals]]
    metrics: dict[str, float] = field(default_factory=dict)  # what building it measured (train/group_baseline_shift)


@dataclass(frozen=True)
class TokenRequest:
    """What a backend computes per token for the step's loss function (trainer/backends/base.py)."""

    temperature: float = 1.0     # logits / temperature before the softmax (0: plain softmax, greedy)
    entropy: bool = False        # the entropy of the same tempered distribution
    greedy: bool = False         # whether each next token is the argmax (greedy decoding would pick it)


@dataclass
class TokenOutputs:
    """Per-token results of one micro-batch's policy forward, each (B, T-1), aligned with its targets."""

    logprobs: "object"           # torch.Tensor, float32, with gradient unless the pass is forward-only
    entropy: "object" = None     # torch.Tensor when TokenRequest.entropy
    greedy: "object" = None      # torch.Tensor (bool) when TokenRequest.greedy
