"""The trainer backend contract: how one rank's models are laid out, run and stepped, and its registry.

The training step itself (trainer/trainer.py: micro-batches, the forward passes an algorithm
declares, loss assembly, proximal logprobs, metrics, reference and teacher models, LoRA naming, HF
export, checkpoint bookkeeping) is the same for every backend. A backend supplies what depends on
the layout and the device: it joins the ranks' process group, builds and shards the policy (and the
critic when asked), runs their forwards, backpropagates, steps the optimizers, gathers full tensors
by Hugging Face name for weight sync and export, and saves and loads its sharded state. Device and
compute dtype are its business (trainer/device.py decides them from `trainer.device` and
`trainer.param_dtype`).

`trainer.backend` names one from `BACKENDS` (or gives a user's `module:Class`). A new backend is one
file plus one line here; trainer/backends/loading.py has the unsharded models every backend starts
from. Loading this module imports no torch (the trainer config validates the name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Protocol

from miles.registry import Registry

if TYPE_CHECKING:
    import torch

    from miles.trainer.batching import MicroBatch
    from miles.trainer.checkpoint import CheckpointWriter
    from miles.trainer.types import TokenOutputs, TokenRequest

    LossFn = Callable[[MicroBatch, TokenOutputs], torch.Tensor]
    AroundForward = Callable[[MicroBatch], ContextManager]


class Backend(Protocol):
    """One rank's share of the policy (and critic) and their optimizers.

    Built on every rank as `cls(cfg, model_path, rank, world_size, master_addr, master_port)` with the
    trainer's config, after the trainer seeded torch's RNG. The constructor joins torch.distributed's
    default process group at `master_addr:master_port` (the trainer all-reduces its micro-batch
    counts and metric sums over it, on `device`) and builds the policy and its optimizer.
    Every method marked collective must be called by all ranks, as often and in the same order."""

    device: "torch.device"
    """Where this rank computes; micro-batches are moved here before a forward."""
    rank: int
    world_size: int
    dp_size: int
    """Data-parallel replicas: each one's ranks (tensor/expert-parallel peers) train the same shard."""
    loss_copies: int
    """Ranks that compute each token's loss (tensor-parallel peers of a replica, or all of its ranks):
    the trainer divides the metric sums it all-reduces by this."""
    model: "torch.nn.Module"
    """The policy module (on FSDP Hugging Face's, whose names R3 hooks and LoRA adapts; on Megatron its
    first GPTModel chunk)."""
    critic: "torch.nn.Module | None"
    """The value model once `build_critic` ran, else None.

    A backend whose modules are not Hugging Face's (Megatron) also has `hf_config` (the HF config it
    was built from: the trainer reads the MoE shape from it) and `routing_replay(mb, replay, sums)`, the
    context `around_forward` enters for R3 in its own routers (as trainer/r3.py's `routing_replay`)."""

    @property
    def last_lr(self) -> float:
        """The policy's learning rate at its last optimizer step (reported as `<prefix>/lr`)."""

    def build_critic(self, lr: float) -> None:
        """Build, lay out and give an optimizer (AdamW at `lr`) to a value model (PPO)."""

    def forward_backward(self, micro_batches: "list[MicroBatch]", loss_fn: "LossFn", request: "TokenRequest",
                         forward_only: bool = False, around_forward: "AroundForward | None" = None,
                         ) -> tuple[float, float]:
        """Run the policy over `micro_batches` in order (on the backend's own schedule: a pipeline
        interleaves their forwards and backwards), compute each one's per-token outputs (B, T-1)
        for `request` (logprobs of the next tokens, in float32, at the request's temperature, and
        entropy or greedy hits when asked; the backend computes them where its logits live, e.g.
        over tensor-parallel vocabulary shards), call `loss_fn(mb, outputs)` for the scalar to
        backpropagate, and accumulate its gradient (none with `forward_only`). `loss_fn` runs
        only where the outputs exist (a pipeline's last stage) and may see a micro-batch whose mask
        and weights cover only the tokens this rank computes (context parallelism).
        `around_forward(mb)` is a context manager the backend enters around that micro-batch's
        model forward (R3's routing replay). Returns (forward seconds, backward seconds).
        Collective."""

    def critic_values(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor | None") -> "torch.Tensor":
        """(B, T-1) float32: the critic's value of the state before each next token, with gradient
        (its backward runs with the policy's loss in `forward_backward`). Collective."""

    def optimizer_step(self) -> float:
        """Clip the gradients to `trainer.grad_clip`, step the optimizers and the LR schedule, zero the
        gradients; returns the policy's global gradient norm before clipping. Collective."""

    def named_tensors(self, all_ranks: bool = False,
                      on_device: bool = False) -> Iterator[tuple[str, "torch.Tensor | None"]]:
        """The policy's full (unsharded) tensors by Hugging Face name (PEFT's, under LoRA), in host
        memory or with `on_device` on `device` (a transport that hands device memory over); tied weights
        once. Collective: every rank iterates to the end; ranks other than 0 get None unless `all_ranks`."""

    def save_state(self, path: str, writer: "CheckpointWriter", local: dict) -> None:
        """Snapshot this rank's sharded state (models, optimizers, schedules) now and queue its write
        under `path` on `writer`, with `local` (the trainer's own state) in this rank's file. Collective."""

    def load_state(self, path: str) -> dict:
        """Restore what `save_state` wrote under `path`; returns the trainer's `local`. Collective."""


BACKENDS: Registry[type[Backend]] = Registry(
    "trainer backend", protocol=Backend,
    hint=" (a class built as cls(cfg, model_path, rank, world_size, master_addr, master_port) that "
         "implements the Backend protocol of miles/trainer/backends/base.py)")
BACKENDS.register("fsdp", "miles.trainer.backends.fsdp:FSDPBackend")
BACKENDS.register("megatron", "miles.trainer.backends.megatron.backend:MegatronBackend")
