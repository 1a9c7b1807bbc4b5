"""Data contracts of generation: a request, its finish reason and its result.

An engine's HTTP layer translates these to and from SGLang-shaped JSON (parsing.py in, `to_sglang`
out); the built-in engine's scheduler never sees JSON.
Non-goal: the control routes' bodies (bodies.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.engine_api.sampling import SamplingParams

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's /pause_generation modes
MEMORY_TAGS = ("weights", "kv_cache")  # what /release_memory_occupation can free


@dataclass(frozen=True)
class GenerateRequest:
    rid: str
    input_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    return_routed_experts: bool = False  # record the top-k expert ids of every token (MoE models)
    # SGLang's logprob_start_len, with return_logprob: -1 = output tokens only; k >= 0 = also the
    # prompt's tokens from position k on (input_token_logprobs).
    logprob_start_len: int = -1
    # The LoRA adapter the request named (SGLang's lora_path), a lora.Adapter; None: the engine's
    # default. Typed loosely: adapters are the built-in engine's (engine/lora.py), above this contract.
    adapter: object | None = field(default=None, compare=False)
    # A vision-language request's images (the built-in engine's multimodal.ServedImage), in the order
    # of their keys in input_ids; holding them keeps their pixels until the request is done.
    images: tuple = field(default=(), compare=False)


@dataclass(frozen=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # stop: the token id or stop string that ended generation
    length: int | None = None  # length: the number of completion tokens
    message: str | None = None  # abort: why

    def to_dict(self) -> dict:
        d: dict = {"type": self.type}
        if self.type == "stop":
            d["matched"] = self.matched
        elif self.type == "length":
            d["length"] = self.length
        elif self.message is not None:
            d["message"] = self.message
        return d


@dataclass(frozen=True)
class GenerateResult:
    rid: str
    text: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float] | None  # one per output token, see sampler.py for the convention
    finish_reason: FinishReason
    weight_version: str  # the version of the weights that produced the last token (a string, as SGLang's)
    cached_tokens: int = 0  # prompt tokens whose KV was reused rather than computed
    # (version, start, end) per run of output tokens one version produced, in order (two if an update
    # landed mid-way): SGLang's meta_info.weight_versions spans.
    weight_versions: tuple[tuple[str, int, int], ...] = ()
    routed_experts: str | None = None  # base64 int32 (prompt + completion - 1, MoE layers, top_k), see models/moe.py
    # With return_logprob: (prompt ids from logprob_start_len, their logprobs), the first None as in SGLang.
    input_logprobs: tuple[tuple[int, ...], tuple[float | None, ...]] | None = None

    def to_sglang(self) -> dict:
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason.to_dict(),
            "weight_version": self.weight_version,
            "weight_versions": [{"version": v, "start": a, "end": b} for v, a, b in self.weight_versions]
            or [{"version": self.weight_version, "start": 0, "end": 0}],
        }
        if self.output_logprobs is not None:
            # SGLang sends both lists whenever logprobs are asked for; the input one is empty at -1.
            ids, lps = self.input_logprobs or ((), ())
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.output_logprobs, self.output_ids)]
        if self.routed_experts is not None:
            meta["routed_experts"] = self.routed_experts
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
