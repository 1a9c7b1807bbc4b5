"""The trainer's config: ranks and backend, optimizer and LR schedule, micro-batching, parallel layouts,
offload, low-precision (QAT) forward, the algorithm (a variant section: its keys follow
`trainer.algorithm.name`) and LoRA.

Loading it imports no torch. Non-goal: backend internals (see trainer/backends/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal

from miles.config.loader import ConfigError
from miles.devices import check_name
from miles.precision.types import FORMATS
from miles.registry import RegistryError
from miles.trainer.algorithms.base import AlgorithmConfig, get_algorithm
from miles.trainer.backends.base import BACKENDS
from miles.trainer.lora import LoraConfig


@dataclass
class TrainerConfig:
    """The trainer section of a run config (`[trainer]`); `[trainer.algorithm]` and `[trainer.lora]` nest in it."""

    num_ranks: int = 1
    """Ranks (processes) of the trainer: tensor × pipeline × context parallel size × data-parallel replicas."""
    backend: str = "fsdp"
    """How the models are laid out over the ranks and devices, run and stepped: fsdp (FSDP2), megatron
    (megatron-core: tensor, sequence, pipeline, context and expert parallelism), or a `module:Class`
    implementing the Backend protocol of miles/trainer/backends/base.py."""
    lr: float = 1e-4
    """AdamW peak learning rate."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the learning rate after warm-up: constant, or linear/cosine decay over lr_decay_steps."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    lr_decay_steps: int = 0
    """Optimizer steps over which linear/cosine schedules decay to min_lr_ratio × lr."""
    min_lr_ratio: float = 0.0
    """Floor of a decaying schedule, as a fraction of lr."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    minibatches_per_step: int = 1
    """Optimizer updates per RL step: the step's batch (its advantages computed over all of it) is split
    into this many minibatches of whole groups, each trained by one update. From the second on, samples
    are off the policy being trained; decoupled PPO and TIS clip and weight against the weights at the
    start of the step (recorded in one extra no-grad forward), the other algorithms against the rollout's
    logprobs. LR warm-up and decay count updates."""
    micro_batch_size: int = 64
    """Most sequences per padded micro-batch on one rank; gradients accumulate across micro-batches."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one micro-batch (padded: rows × longest row; packed: total length); 0 = none. Rows
    fill micro-batches longest first, so a batch with a long tail of lengths is not padded to its longest
    row throughout (a sequence longer than the budget gets a micro-batch of its own)."""
    pack_sequences: Literal[False, True, "auto"] = "auto"
    """Pack sequences end to end into one row per micro-batch (no attention across sequences): true
    always, false never (padded rows, sharing prompts as `share_prompts` allows), "auto" each step
    where the backend attends packed rows a sequence at a time and they compute fewer tokens than the
    padded rows would (long responses against their prompts pack; short ones share prompts:
    `miles bench layouts`). Full-attention models of the llama, mistral, qwen2, qwen3 and qwen3_moe
    families on the fsdp backend attend each sequence on its own (trainer/packed_attention.py), so a
    sequence costs its own length squared; with true, other models attend through transformers'
    block-diagonal mask over the whole row. "auto" never packs a vision-language batch or PPO's."""
    share_prompts: bool = True
    """Compute a prompt once per micro-batch for all the samples that continue it (a group's), each
    sample's response then on top of its KV: the same loss and gradients, less compute when prompts are
    long against responses. Padded rows of full-attention dense models (llama, mistral, qwen2, qwen3) on
    a one-rank fsdp trainer, without activation checkpointing or a reference, in-trainer teacher or
    critic forward; elsewhere every row computes its whole sequence."""
    ref_update_every: int = 0
    """Refresh the reference model from the policy every this many steps (0 = keep the initial one)."""
    routing_replay: bool = False
    """Rollout Routing Replay (R3, MoE models): the policy forward routes each token to the experts the
    engine chose (needs rollout.return_routed_experts); gate weights still come from the trainer's router."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks per model replica: attention heads, MLP columns and the vocabulary split over
    them (fsdp: DTensor, transformers' TP plan; megatron: megatron-core's)."""
    expert_parallel_size: int = 1
    """Expert-parallel ranks for MoE models: the experts split over them (fsdp: within a replica, transformers'
    EP plan; megatron: within the data × context parallel ranks, as megatron-core defines it)."""
    expert_tensor_parallel_size: int = 1
    """megatron: tensor-parallel ranks of each expert's MLP (1 = every expert whole on its rank)."""
    pipeline_parallel_size: int = 1
    """megatron: pipeline stages per replica, each holding consecutive decoder layers (1F1B schedule)."""
    virtual_pipeline_parallel_size: int = 1
    """megatron: model chunks per pipeline stage (> 1: the interleaved 1F1B schedule)."""
    context_parallel_size: int = 1
    """megatron: ranks that split each sequence (2 × this many chunks, balanced for causal attention)."""
    sequence_parallel: bool = False
    """megatron: split the activations outside attention and MLP along the sequence over the TP ranks."""
    offload_optimizer: Literal["none", "cpu", "disk"] = "none"
    """Keep optimizer state off the accelerator between steps: in CPU memory or in files on disk."""
    offload_dir: str = ""
    """Folder for disk offload (empty = a temporary folder per rank)."""
    offload_bucket_mb: int = 64
    """Optimizer state streamed back per bucket of parameters of about this size around the step."""
    num_threads: int = 1
    """torch threads per trainer process (keep at 1 when processes share few cores); 0 = auto: in a
    run, the trainer pool's cores shared by its ranks (placement.py), else every core this process may use."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer's ranks compute: auto (cuda when the run's machines have a GPU, else cpu), cpu,
    or cuda (rank r on visible GPU r mod count; docs/scaling.md says what ran where)."""
    collective_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of the trainer's group: auto = gloo on cpu, nccl on cuda."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward rather than keep them from the forward:
    memory for longer micro-batches, at about a third more compute per step."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype the forward and backward compute in. Master weights and optimizer state stay float32;
    bfloat16 uses FSDP2 mixed precision (bfloat16 parameters, float32 gradient reduction)."""
    collective_timeout_s: float = 600.0
    """A collective (all-gather, all-reduce) waiting longer than this fails the step with a clear error
    instead of hanging on a dead or stalled rank."""
    quantization: str = "none"
    """Quantization-aware training: the policy's Linear and MoE expert weights (not routers; the LM head
    and embeddings only with quantize_embeddings) pass through this format's quantize-dequantize in every
    forward, gradients go straight through to the float32 master weights: none, or a format of
    docs/precision.md (fp8, mxfp8, nvfp4, int4, ...)."""
    quantize_embeddings: bool = False
    """Train the input embedding and the LM head (one weight when tied) in `quantization`'s format too;
    set it when the engines serve them so (rollout.engine.quantize_embeddings)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm and its knobs."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (rank 0 = full fine-tuning)."""
    train_vision_tower: bool = False
    """Vision-language policies: train the vision tower (and its merger) too; false keeps it frozen
    (no gradient, no optimizer state). Weight sync sends it either way."""

    def validate(self) -> None:
        if self.num_ranks < 1:
            raise ConfigError("trainer.num_ranks must be >= 1")
        self._validate_backend()
        if self.collective_timeout_s <= 0:
            raise ConfigError("trainer.collective_timeout_s must be > 0")
        if self.lr <= 0:
            raise ConfigError("trainer.lr must be > 0")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key} = {getattr(self, key)}: AdamW needs a value in [0, 1) "
                                  "(the usual ones are 0.9 and 0.999)")
        if self.weight_decay < 0:
            raise ConfigError(f"trainer.weight_decay = {self.weight_decay}: a negative decay grows the weights; "
                              "set it >= 0 (0 = none)")
        if self.grad_clip < 0:
            # A negative bound silently measures without clipping (backends/fsdp.py::clip_grad_norm); 0 is the
            # way to say "off".
            raise ConfigError(f"trainer.grad_clip = {self.grad_clip}: set it > 0 to clip the gradient norm, "
                              "or 0 to turn clipping off")
        if self.num_threads < 0:
            raise ConfigError(f"trainer.num_threads = {self.num_threads}: set it >= 1, or 0 for the cores its pool owns")
        if self.minibatches_per_step < 1:
            raise ConfigError(f"trainer.minibatches_per_step = {self.minibatches_per_step}: set it >= 1 "
                              "(1 = one optimizer update per step)")
        if self.micro_batch_size < 1 or self.max_tokens_per_micro_batch < 0:
            raise ConfigError("trainer.micro_batch_size must be >= 1 and trainer.max_tokens_per_micro_batch >= 0")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ConfigError("trainer.lr_schedule must be constant, linear or cosine")
        if self.lr_schedule != "constant" and self.lr_decay_steps < 1:
            raise ConfigError(f"trainer.lr_schedule = {self.lr_schedule!r} needs trainer.lr_decay_steps >= 1")
        if self.lr_warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1 or self.ref_update_every < 0:
            raise ConfigError("trainer.lr_warmup_steps >= 0, 0 <= trainer.min_lr_ratio <= 1 and "
                              "trainer.ref_update_every >= 0 are required")
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        self._validate_layout()
        check_name(self.device, "trainer.device")
        if self.collective_backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"trainer.collective_backend = {self.collective_backend!r}: choose auto, gloo or nccl")
        if self.collective_backend == "nccl" and self.device == "cpu":
            raise ConfigError("trainer.collective_backend = 'nccl' needs GPUs: set trainer.device = 'cuda', or "
                              "trainer.collective_backend = 'auto' (gloo on cpu)")
        if self.param_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"trainer.param_dtype = {self.param_dtype!r}: choose float32 or bfloat16")
        if self.backend == "fsdp" and (self.param_dtype != "float32" or self.device == "cuda") and (tp > 1 or ep > 1):
            # The tensor/expert-parallel layouts build their own CPU meshes in float32 (trainer/parallel.py).
            raise ConfigError("tensor/expert parallelism runs on cpu in float32 only: set trainer.device = 'cpu' "
                              "and trainer.param_dtype = 'float32', or tensor_parallel_size = "
                              "expert_parallel_size = 1")
        if self.offload_optimizer not in ("none", "cpu", "disk") or self.offload_bucket_mb < 1:
            raise ConfigError("trainer.offload_optimizer must be none, cpu or disk, and offload_bucket_mb >= 1")
        self.algorithm.validate()  # the name first: the critic check below builds the algorithm
        if self.backend == "megatron":
            self._validate_megatron()  # before the FSDP-specific refusals below, which name other fixes
        if get_algorithm(self.algorithm).needs_critic and self.pack_sequences is True:
            raise ConfigError("PPO's GAE runs along unpacked rows: set trainer.pack_sequences = false "
                              "with trainer.algorithm.name = 'ppo'")
        if self.quantization != "none" and self.quantization not in FORMATS:
            raise ConfigError(f"trainer.quantization = {self.quantization!r} is not a format; choose none or one "
                              f"of {', '.join(FORMATS)}")
        if self.quantization != "none" and (self.lora.rank or tp > 1 or ep > 1):
            # Adapters would train outside the quantized weight, and DTensor shards would be scaled per
            # shard rather than per block of the full weight: neither is the format the engine serves.
            raise ConfigError(f"trainer.quantization = {self.quantization!r} needs full fine-tuning without tensor/"
                              "expert parallelism: set trainer.lora.rank = 0 and tensor_parallel_size = "
                              "expert_parallel_size = 1, or trainer.quantization = 'none'")
        if self.quantize_embeddings and self.quantization == "none":
            raise ConfigError("trainer.quantize_embeddings = true needs a format: set trainer.quantization (e.g. "
                              "'nvfp4'), or trainer.quantize_embeddings = false")
        if self.lora.rank and (tp > 1 or ep > 1):
            raise ConfigError("LoRA with tensor/expert parallelism is not supported: set trainer.lora.rank = 0 "
                              "or tensor_parallel_size = expert_parallel_size = 1")


    @property
    def replica_ranks(self) -> int:
        """Consecutive ranks that hold one model replica between them and train the same data shard."""
        if self.backend == "megatron":
            return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    def _validate_layout(self) -> None:
        sizes = {k: getattr(self, k) for k in ("tensor_parallel_size", "expert_parallel_size",
                                               "expert_tensor_parallel_size", "pipeline_parallel_size",
                                               "virtual_pipeline_parallel_size", "context_parallel_size")}
        for key, value in sizes.items():
            if value < 1:
                raise ConfigError(f"trainer.{key} = {value}: set it >= 1")
        tp, ep, pp, cp = (sizes[k] for k in ("tensor_parallel_size", "expert_parallel_size",
                                            "pipeline_parallel_size", "context_parallel_size"))
        if self.backend != "megatron":
            only = [k for k in ("expert_tensor_parallel_size", "pipeline_parallel_size",
                                "virtual_pipeline_parallel_size", "context_parallel_size") if sizes[k] > 1]
            if self.sequence_parallel:
                only.append("sequence_parallel")
            if only:
                raise ConfigError(f"trainer.{only[0]} needs trainer.backend = 'megatron' (the {self.backend} backend "
                                  "lays out tensor and expert parallelism only)")
            if self.num_ranks % max(tp, ep):
                raise ConfigError(f"trainer.num_ranks ({self.num_ranks}) must be a multiple of "
                                  f"tensor_parallel_size ({tp}) and expert_parallel_size ({ep})")
            return
        width = tp * pp * cp
        if self.num_ranks % width:
            raise ConfigError(f"trainer.num_ranks ({self.num_ranks}) must be a multiple of tensor × pipeline × context "
                              f"parallel size ({tp} × {pp} × {cp} = {width})")
        expert_width = self.expert_tensor_parallel_size * ep
        if (self.num_ranks // pp) % expert_width:
            raise ConfigError(f"trainer.num_ranks / pipeline_parallel_size ({self.num_ranks // pp}) must be a multiple "
                              f"of expert_tensor_parallel_size × expert_parallel_size ({expert_width}): experts are "
                              "laid out over the ranks of one pipeline stage")
        if self.sequence_parallel and tp == 1:
            raise ConfigError("trainer.sequence_parallel splits activations over the tensor-parallel ranks: set "
                              "trainer.tensor_parallel_size > 1, or sequence_parallel = false")
        if self.virtual_pipeline_parallel_size > 1 and pp == 1:
            raise ConfigError("trainer.virtual_pipeline_parallel_size > 1 interleaves pipeline stages: set "
                              "trainer.pipeline_parallel_size > 1, or virtual_pipeline_parallel_size = 1")

    def _validate_megatron(self) -> None:
        """What the Megatron backend cannot serve yet, refused before any rank starts."""
        refused = [
            (get_algorithm(self.algorithm).needs_critic, f"a value model (trainer.algorithm.name = "
             f"{self.algorithm.name!r})", "choose an algorithm without a critic (grpo, dr_grpo, ...)"),
            (self.lora.rank > 0, "LoRA (trainer.lora.rank > 0)", "set trainer.lora.rank = 0"),
            (self.quantization != "none", f"quantization-aware training (trainer.quantization = "
             f"{self.quantization!r})", "set trainer.quantization = 'none'"),
            (self.pack_sequences is True, "packed micro-batches (THD attention is TransformerEngine's)",
             "set trainer.pack_sequences = false"),
            (self.offload_optimizer != "none", "optimizer offload", "set trainer.offload_optimizer = 'none'"),
            (self.routing_replay and self.activation_checkpointing, "Rollout Routing Replay with recomputed "
             "activations (the recompute would route freely)", "set trainer.activation_checkpointing = false"),
            (self.param_dtype != "float32" and self.device != "cuda", "bfloat16 on a CPU",
             "set trainer.param_dtype = 'float32', or trainer.device = 'cuda'"),
            (self.pipeline_parallel_size > 1 and self.minibatches_per_step > 1,
             "proximal logprobs across pipeline stages (trainer.minibatches_per_step > 1)",
             "set trainer.minibatches_per_step = 1, or pipeline_parallel_size = 1"),
        ]
        for bad, what, fix in refused:
            if bad:
                raise ConfigError(f"trainer.backend = 'megatron' does not support {what} yet: {fix}, or "
                                  "trainer.backend = 'fsdp'")

    def _validate_backend(self) -> None:
        if ":" in self.backend:  # a user's module:Class, loaded and checked against the protocol now
            try:
                BACKENDS.get(self.backend)
            except RegistryError as e:
                raise ConfigError(f"trainer.backend: {e}") from None
        elif self.backend not in BACKENDS:
            # Built-ins are named without importing them (fsdp imports torch; loading a config must not).
            raise ConfigError(f"trainer.backend = {self.backend!r} is unknown: choose one of {BACKENDS.names()} "
                              f"or give module:Class{BACKENDS.hint}")


def lr_lambda(cfg: TrainerConfig) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step `s` (0-based)."""
    def f(s: int) -> float:
        if s < cfg.lr_warmup_steps:
            return (s + 1) / (cfg.lr_warmup_steps + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        p = min(1.0, (s - cfg.lr_warmup_steps) / cfg.lr_decay_steps)
        shape = 1.0 - p if cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape
    return f
