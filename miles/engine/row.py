"""A request's life in the engine: from submission to result, through the running batch and back to
the queue when it is retracted. The model runner owns the batch; a Row is what it keeps per request.

Sampling generators stay on the host whatever the engine's device: a seeded request then draws the
same uniforms on cpu and cuda, so its tokens do not depend on where the engine runs (SeededDraws,
sampler.py).

Non-goal: the batch tensors (kv_cache.py) and the request's wire form (types.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from miles.engine_api.types import FinishReason, GenerateRequest
from miles.models.moe import encode_routed_experts
from miles.engine.sampler import SeededDraws


@dataclass
class Row:
    """A request from submission to result; it may leave the running batch and come back (retract)."""

    req: GenerateRequest
    future: Future
    draws: SeededDraws | None  # a seeded request's uniforms; None draws from the engine's generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    weight_version: str | None = None  # version of the weights that produced the latest token
    # SGLang's spans: [version, first token, end] for each run of tokens one version produced, in order.
    weight_versions: list[list] = field(default_factory=list)
    cached_tokens: int | None = None  # prompt tokens whose KV came from the cache, set at first admission
    answered: bool = False  # its future is resolved; it may still occupy a row of the batch tensors
    kv_version: int | None = None  # weights_epoch its KV was computed under; None once mixed
    routed: list[torch.Tensor] = field(default_factory=list)  # (tokens, MoE layers, top_k) chunks, in order
    # Prompt-token logprobs from req.logprob_start_len (the first None, as SGLang's), set at first prefill.
    input_logprobs: list[float | None] | None = None
    # Failure isolation (scheduler.py): "suspect" while it waits to run a step alone after a step it
    # was in raised, "cleared" once it did without failing; `unblamed` counts failed steps it was in
    # that no request could be blamed for.
    isolation: str | None = None
    unblamed: int = 0
    # Streaming (scheduler.py): called on the scheduler's thread with each run of new output tokens
    # and their logprobs; `streamed` counts the tokens it was given.
    listener: Callable[[list[int], list[float]], None] | None = None
    streamed: int = 0

    @classmethod
    def of(cls, req: GenerateRequest, future: Future, listener=None) -> Row:
        seed = req.params.seed
        return cls(req, future, None if seed is None else SeededDraws(seed), listener=listener)

    def input_logprob_start(self) -> int | None:
        """The prompt position its input logprobs start at, while they are still to be computed."""
        k = self.req.logprob_start_len
        if self.input_logprobs is None and self.req.return_logprob and 0 <= k < len(self.req.input_ids):
            return k
        return None

    def prefill_ids(self) -> tuple[int, ...]:
        # After a retract the generated tokens are part of what must be prefilled again.
        return self.req.input_ids + tuple(self.output_ids)

    def routed_experts_wire(self) -> str:
        """Its tokens' routed experts as they travel; empty when it finished before its prompt was computed
        (aborted in the queue, max_new_tokens=0)."""
        return encode_routed_experts(torch.cat(self.routed).cpu()) if self.routed else ""

    def input_logprob_pairs(self) -> tuple[tuple[int, ...], tuple[float | None, ...]]:
        """(prompt ids from logprob_start_len, their logprobs); empty for -1, k = prompt length, or when not
        yet computed (aborted in the queue)."""
        k = self.req.logprob_start_len
        if k < 0 or self.input_logprobs is None:
            return (), ()
        return self.req.input_ids[k:], tuple(self.input_logprobs)
