"""Configuration of one built-in engine process.

Non-goal: router, fleet or trainer settings; those live with their own components.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from miles.config.loader import ConfigError
from miles.devices import check_name
from miles.net import DEFAULT_MAX_BODY_MB, LOOPBACK, check_admin_exposure
from miles.precision.types import FORMATS
from miles.engine_api.tool_calls import TOOL_PARSERS

FAST_DECODE = ("auto", "on", "off")


@dataclass
class EngineConfig:
    model_path: str
    """Hugging Face checkpoint directory (or hub id) to serve; also the tokenizer's path."""
    dtype: str = "float32"
    """Parameter dtype the model is loaded in: float32, bfloat16 or float16."""
    device: str = "auto"
    """Where the engine computes and keeps its weights and KV: auto (cuda when the process sees a GPU,
    else cpu), cpu or cuda."""
    memory_fraction: float = 0.4
    """Share of the device's memory (the GPU's, or the host's RAM on cpu) the engine may hold: weights,
    prefix cache and the running batch's KV, as SGLang's --mem-fraction-static. The rest is left to a
    trainer sharing the device. An engine whose weights and one full-context sequence do not fit is
    refused at start; requests beyond the KV budget wait for room."""
    quantization: str = "none"
    """Serve the Linear and MoE expert weights (not routers; the LM head and embeddings only with
    quantize_embeddings) in this low-precision format, dequantized in each matmul: none, or a format of
    docs/precision.md (fp8, mxfp8, nvfp4, int4, ...).
    Match trainer.quantization so the trainer trains the policy the engine serves."""
    quantize_embeddings: bool = False
    """Also serve the input embedding and the LM head (one weight when tied) in `quantization`'s format:
    fewer bytes per weight push, at an accuracy cost docs/precision.md measures. Match
    trainer.quantize_embeddings."""
    host: str = LOOPBACK
    """Interface the HTTP server binds to; loopback unless the engine must be reached from other hosts
    (which needs admin_token, or insecure_admin)."""
    port: int = 0
    """HTTP port; 0 picks a free one (read the chosen URL from the running server)."""
    max_batch_size: int = 256
    """Most requests decoded together in one forward; later ones wait for a free slot."""
    max_prefill_tokens: int = 8192
    """Most prompt tokens admitted into one prefill: further waiting requests are prefilled at the next
    step, after a decode step of the running rows, so a burst of long prompts does not stall decoding
    (a single longer prompt is still computed whole; copies of one prompt count once, as the prefill
    computes them once). 0: no limit."""
    fast_decode: str = "auto"
    """Decode over the static KV cache (static_kv.py): allocated once, written in place, attention through
    SDPA, sampling on the device. auto: on for cuda when the KV budget gives each of max_batch_size rows
    the whole context_length (else off, logged with the fix), off for cpu; on: on, serving a shorter
    context_length when the budget is short; off. Models outside decode_forward.FAMILIES decode eagerly."""
    prefill_chunk_tokens: int = 2048
    """With fast_decode, a prompt longer than this is prefilled this many tokens per engine step, a decode
    step of the running rows between two chunks, so it does not stall them (requests asking for input
    logprobs or routed experts, or on a LoRA adapter, are prefilled whole). 0: never split a prompt."""
    cuda_graphs: bool = True
    """With fast_decode on cuda, replay decode steps as CUDA graphs, one per batch/length bucket
    (graphs.py). Batches on a LoRA adapter or returning routed experts, and quantized serving, decode
    without graphs."""
    context_length: int | None = None
    """Longest prompt + completion in tokens; None uses the model's max_position_embeddings."""
    admin_token: str | None = None
    """When set, admin endpoints (weight updates, cache flush) need `Authorization: Bearer <token>`;
    `miles train` always sets a fresh random one."""
    insecure_admin: bool = False
    """Allow binding a non-loopback host without admin_token, leaving every admin route open to the
    network; only for a network whose every user is trusted."""
    max_request_mb: float = DEFAULT_MAX_BODY_MB
    """Largest request body the HTTP server reads; larger ones are answered 413."""
    num_threads: int = 1
    """torch intra-op threads in the engine process; keep it to the cores this engine owns. 0 = auto: in a
    run, the engine pool's cores shared by its engines (placement.py), else every core this process may use."""
    seed: int = 0
    """Seed of the engine-wide sampling generator used by requests without a sampling_seed."""
    default_max_new_tokens: int = 128
    """Completion budget of requests that do not set sampling_params.max_new_tokens."""
    tool_call_parser: str = "hermes"
    """How /v1/chat/completions reads tool calls out of a reply when the request offers tools (SGLang's
    --tool-call-parser): hermes (Qwen2.5/Qwen3), llama3_json, none, or module:Class."""
    weight_update_timeout_s: float = 120.0
    """How long joining a weight-update group or one broadcast may take before it fails."""
    prefix_cache: bool = True
    """Reuse the KV of prompt prefixes seen before (GRPO groups, multi-turn histories)."""
    prefix_block_size: int = 8
    """Tokens per prefix-cache block; prefixes are reused in whole blocks."""
    prefix_cache_mb: float = 512.0
    """Memory the prefix cache may hold; least recently used blocks are evicted beyond it."""
    offload_dir: str | None = None
    """Where /release_memory_occupation parks the weights; None uses the system temp directory."""
    sglang_only: bool = False
    """Serve SGLang's protocol and nothing more: every miles extension (staged commit, p2p buffers,
    disk deltas, expected-checksum verification, the colocated handoff) is switched off and not
    advertised, so a trainer drives this engine exactly as it drives a plain SGLang server."""
    max_lora_adapters: int = 8
    """Most LoRA adapters loaded at once (/load_lora_adapter); a load beyond it is refused until one is unloaded."""
    reuse_weight_memory: bool = True
    """Keep the memory a weight update displaced as the next update's receive buffers: updates skip
    first-touch page faults, at the cost of a second copy of the weights held between updates."""

    def validate(self) -> None:
        check_name(self.device, "engine device")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"engine memory_fraction = {self.memory_fraction}: set it in (0, 1] (the share of "
                              "the device's memory the engine may hold; 0.4 leaves the rest to a trainer)")
        if self.max_batch_size < 1:
            raise ConfigError("engine max_batch_size must be >= 1")
        if self.max_prefill_tokens < 0:
            raise ConfigError(f"engine max_prefill_tokens = {self.max_prefill_tokens}: set it >= 0 (0: no limit)")
        if self.prefill_chunk_tokens < 0:
            raise ConfigError(f"engine prefill_chunk_tokens = {self.prefill_chunk_tokens}: set it >= 0 "
                              "(0: never split a prompt)")
        if self.fast_decode not in FAST_DECODE:
            raise ConfigError(f"engine fast_decode = {self.fast_decode!r}: choose one of {', '.join(FAST_DECODE)}")
        if self.prefix_block_size < 1:
            raise ConfigError("engine prefix_block_size must be >= 1 (8 is a good default)")
        if self.prefix_cache_mb < 0:
            raise ConfigError("engine prefix_cache_mb must be >= 0; set prefix_cache = false to disable it")
        if self.num_threads < 0:
            raise ConfigError(f"engine num_threads = {self.num_threads}: set it >= 1 (the cores this engine owns), "
                              "or 0 for auto")
        if self.default_max_new_tokens < 1:
            raise ConfigError(f"engine default_max_new_tokens = {self.default_max_new_tokens}: set it >= 1")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"engine context_length = {self.context_length}: set it >= 2 (a prompt token and a "
                              "new one), or leave it unset for the model's max_position_embeddings")
        if self.weight_update_timeout_s <= 0:
            raise ConfigError(f"engine weight_update_timeout_s = {self.weight_update_timeout_s}: set it > 0 (seconds)")
        if self.quantization != "none" and self.quantization not in FORMATS:
            raise ConfigError(f"engine quantization = {self.quantization!r} is not a format; choose none or one of "
                              f"{', '.join(FORMATS)}")
        if self.quantize_embeddings and self.quantization == "none":
            raise ConfigError("engine quantize_embeddings = true needs a format: set engine quantization (e.g. "
                              "'nvfp4'), or quantize_embeddings = false")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"engine port = {self.port}: set it in 0..65535 (0 picks a free port)")
        if self.max_lora_adapters < 0:
            raise ConfigError(f"engine max_lora_adapters = {self.max_lora_adapters}: set it >= 0 (0 serves no adapters)")
        if self.tool_call_parser not in TOOL_PARSERS and ":" not in self.tool_call_parser:
            raise ConfigError(f"engine tool_call_parser = {self.tool_call_parser!r}: choose one of "
                              f"{', '.join(TOOL_PARSERS.names())}, or give module:Class")
        if self.max_request_mb <= 0:
            raise ConfigError(f"engine max_request_mb = {self.max_request_mb}: set it > 0 (64 is the default)")

    def check_admin_exposure(self) -> None:
        """Refuse a tokenless engine on a non-loopback host (see net.check_admin_exposure). Not part of
        validate(): a run's engine section gets its token only when the run starts the engine."""
        check_admin_exposure(self.host, self.admin_token, self.insecure_admin, "engine")

    def public_dict(self) -> dict:
        """The fields safe to show to any client: everything but the admin token."""
        d = asdict(self)
        d.pop("admin_token")
        d["admin_token_set"] = self.admin_token is not None
        return d
