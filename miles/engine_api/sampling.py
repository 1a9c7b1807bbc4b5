"""SamplingParams: how a request's tokens are drawn, as clients send it and engines read it.

One frozen dataclass on both ends of /generate: a client builds it and sends `to_json()` (SGLang's
`sampling_params` object), the engine parses that body back into one (parsing.parse_sampling_params).
Non-goal: the sampling itself (the built-in engine's engine/sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to draw a request's tokens, on both ends of /generate: clients build it and send `to_json()`,
    the engine parses that body back into one (engine_api.parsing.parse_sampling_params) and samples with it.

    The first six fields come first so clients may pass them positionally; `seed` travels as
    SGLang's `sampling_seed`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    max_new_tokens: int = 128
    seed: int | None = None  # a seeded request draws from its own generator, whatever shares its batch
    ignore_eos: bool = False
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        # top_k == 1 also always picks the argmax; the logprob still follows the temperature.
        return self.temperature == 0.0 or self.top_k == 1

    def to_json(self) -> dict:
        """The SGLang `sampling_params` object; optional fields only when they differ from the default."""
        out = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
               "max_new_tokens": self.max_new_tokens}
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.min_p:
            out["min_p"] = self.min_p
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if not self.skip_special_tokens:
            out["skip_special_tokens"] = False
        if self.no_stop_trim:
            out["no_stop_trim"] = True
        return out
