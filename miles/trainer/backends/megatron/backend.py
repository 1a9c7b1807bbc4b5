"""The Megatron-LM backend: the policy as megatron-core GPT model chunks with tensor, sequence,
pipeline (1F1B, interleaved with virtual stages), context and expert parallelism, trained by
megatron-core's own forward-backward schedules, DDP and optimizer.

Rank layout: megatron-core's process groups with data parallelism outermost (order tp-cp-ep-pp-dp),
so the ranks of one replica are consecutive and the trainer group hands each replica its shard as
it does for FSDP. The step (trainer/trainer.py) hands this backend micro-batches and a loss over
per-token outputs; the outputs are computed from the last stage's vocabulary-parallel logits
(logprobs.py) inside the schedule, which then owns the backward. Weights come in from a Hugging Face
checkpoint and leave under HF names (hf_layout.py): each rank reads the checkpoint and keeps its
shard; exports and weight sync gather TP shards within their group and experts within their EP group,
one layer at a time, each stage broadcasting its layers over the pipeline group as they are made.
On a CPU, megatron-core runs behind cpu_adapter.py (pinned to one release).

Context parallelism runs in the project's own core attention on the local layers
(context_parallel.py: megatron-core's local attention asserts CP = 1).
Refused at config load (trainer/config.py): a critic (PPO), LoRA, quantization-aware training,
packed micro-batches (THD attention is TransformerEngine's), bfloat16 without a GPU. Routing replay
(R3) runs in megatron-core's own routers (router_replay.py). Resumable checkpoints are per-rank
shards of this layout plus a layout-free copy under HF names, so a run resumes at another layout.
Non-goal: the step itself, the algorithms (the trainer's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Iterator

import torch
import torch.distributed as dist
from transformers import AutoConfig

from miles.models.loading import load_model
from miles.trainer.backends.megatron import cpu_adapter
from miles.trainer.backends.megatron.hf_layout import (
    Rule, expert_names, gate_up_rule, layer_rules, rope_theta, top_rules, transformer_config_kwargs)
from miles.trainer.config import TrainerConfig, lr_lambda
from miles.trainer.device import HOST, join_trainer_group
from miles.trainer.types import TokenOutputs

# megatron-core after the adapter: its modules are imported once the CPU patches can be applied.
if not torch.cuda.is_available():
    cpu_adapter.apply()
from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from miles.trainer.backends.megatron.context_parallel import (  # noqa: E402
    ContextParallelAttention, gather_tokens, local_chunks, local_positions)
from miles.trainer.backends.megatron.logprobs import vocab_parallel_token_outputs  # noqa: E402
from miles.trainer.backends.megatron.router_replay import (  # noqa: E402
    engine_ids_in_router_order, replay_family, replaying)
from miles.trainer.backends.megatron.state import ResumableState  # noqa: E402


class MegatronBackend(ResumableState):
    """The policy's megatron-core chunks on this rank, their DDP wrappers and optimizer."""

    def __init__(self, cfg: TrainerConfig, model_path: str, rank: int, world_size: int,
                 master_addr: str, master_port: int):
        self.device = join_trainer_group(cfg, rank, world_size, master_addr, master_port)
        self.cfg, self.rank, self.world_size, self.model_path = cfg, rank, world_size, model_path
        tp, pp, cp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.context_parallel_size
        vpp = cfg.virtual_pipeline_parallel_size if cfg.virtual_pipeline_parallel_size > 1 else None
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=cp, expert_model_parallel_size=cfg.expert_parallel_size,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel_size, order="tp-cp-ep-pp-dp",
            create_gloo_process_groups=False,
            distributed_timeout_minutes=max(1, int(cfg.collective_timeout_s // 60)))
        # The RNG tracker's seeding and the throwaway initialisation below draw from torch's generator,
        # which the trainer seeded for itself: it is put back as it was.
        rng = torch.get_rng_state()
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        self.dp_size = world_size // (tp * pp * cp)
        self.loss_copies = tp * cp  # the last stage's TP and CP peers compute the same loss (context_parallel.py)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.tconfig = TransformerConfig(
            **transformer_config_kwargs(self.hf_config), tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
            sequence_parallel=cfg.sequence_parallel, expert_model_parallel_size=cfg.expert_parallel_size,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel_size, params_dtype=torch.float32,
            pipeline_dtype=torch.float32, use_cpu_initialization=self.device.type == "cpu",
            # Initialised only to be overwritten by the checkpoint, but megatron-core marks which
            # weights are split (and along which dimension) only when it initialises them.
            perform_initialization=True, variable_seq_lengths=False, moe_token_dispatcher_type="alltoall",
            recompute_granularity="full" if cfg.activation_checkpointing else None,
            recompute_method="uniform" if cfg.activation_checkpointing else None,
            recompute_num_layers=1 if cfg.activation_checkpointing else None)
        with cpu_adapter.building_on_cpu():
            self.chunks = self._build_chunks(vpp or 1)
        torch.set_rng_state(rng)
        self._load_hf(load_model(model_path, "float32").state_dict())
        self.ddp = [DistributedDataParallel(config=self.tconfig, module=c, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)) for c in self.chunks]
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2, adam_eps=1e-8, clip_grad=0.0, params_dtype=torch.float32,
            use_distributed_optimizer=False), self.ddp, config_overrides={},  # {}: decay every weight, as AdamW does
            use_gloo_process_groups=False)
        self._uniform_shape: tuple[int, int] | None = None
        self._lr_at = lr_lambda(cfg)
        self._updates = 0
        self._set_lr()
        self.model = self.chunks[0]
        self.critic = None

    # -- building and loading ------------------------------------------------------------------
    def _build_chunks(self, vpp: int) -> list[GPTModel]:
        spec = get_gpt_layer_local_spec(num_experts=self.tconfig.num_moe_experts, moe_grouped_gemm=False,
                                        qk_layernorm=self.tconfig.qk_layernorm, normalization="RMSNorm")
        if self.cfg.context_parallel_size > 1:  # megatron-core's local attention asserts CP = 1
            spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
        hf = self.hf_config
        chunks = []
        for stage in range(vpp):
            vp = stage if vpp > 1 else None
            model = GPTModel(
                config=self.tconfig, transformer_layer_spec=spec, vocab_size=hf.vocab_size,
                max_sequence_length=hf.max_position_embeddings,
                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                parallel_output=True, share_embeddings_and_output_weights=hf.tie_word_embeddings,
                position_embedding_type="rope", rotary_base=rope_theta(hf), vp_stage=vp)
            model.to(self.device)
            model.train()
            for name, p in model.named_parameters():
                # megatron-core marks expert weights (allreduce = False) only under expert parallelism; the
                # expert-TP group shards them whatever the EP size, so they are marked here once.
                p.is_expert_weight = ".experts." in name
            chunks.append(model)
        return chunks

    def _params(self, chunks=None) -> Iterator[tuple[Rule | None, str, int | None, torch.nn.Parameter]]:
        """Every local parameter (of `chunks`, default all) with its rule: (rule, megatron name, global
        layer, parameter), in the model's order; experts come with rule None (their own path) and the
        local expert index in the name."""
        hf = self.hf_config
        tops = {r.mcore: r for r in top_rules(hf)}
        for chunk in self.chunks if chunks is None else chunks:
            numbers = {f"decoder.layers.{j}.": layer.layer_number - 1 for j, layer in enumerate(chunk.decoder.layers)}
            for name, p in chunk.named_parameters():
                if name in tops:
                    yield tops[name], name, None, p
                    continue
                if name == "output_layer.weight":  # a later stage's copy of the tied embedding
                    yield Rule(name, ("model.embed_tokens.weight",), lambda ts: ts[0], lambda t: []), name, None, p
                    continue
                prefix = next((k for k in numbers if name.startswith(k)), None)
                if prefix is None:
                    raise RuntimeError(f"no Hugging Face name for megatron parameter {name}")
                i, rest = numbers[prefix], name[len(prefix):]
                if ".experts." in rest:
                    yield None, rest, i, p
                    continue
                rule = next((r for r in layer_rules(hf, i, _tp_size(p)) if r.mcore == rest), None)
                if rule is None:
                    raise RuntimeError(f"no Hugging Face name for megatron parameter {name}")
                yield rule, rest, i, p

    @torch.no_grad()
    def _load_hf(self, state: dict, into=None) -> None:
        """Copy this rank's shard of every weight from the HF state dict (or, with `into(p, shard)`, hand
        each parameter's shard of a tensor laid out like the weights, e.g. an Adam moment, to `into`)."""
        e_local = (self.tconfig.num_moe_experts or 0) // self.cfg.expert_parallel_size
        ep_rank = mpu.get_expert_model_parallel_rank()
        into = into or (lambda p, shard: p.copy_(shard))
        for rule, name, layer, p in self._params():
            if rule is None:  # ...local_experts.{k}.linear_fc{1,2}.weight
                k = int(name.split("local_experts.")[1].split(".")[0])
                gate_up, down = expert_names(layer)
                e = ep_rank * e_local + k
                if "linear_fc1" in name:
                    full = gate_up_rule("", (), _tp_size(p), stacked=True).to_mcore([state[gate_up][e]])
                else:
                    full = state[down][e]
            else:
                full = rule.to_mcore([state[n] for n in rule.hf])
            into(p, _shard_of(full, p))

    # -- the step ------------------------------------------------------------------------------
    @property
    def last_lr(self) -> float:
        return self.cfg.lr * self._lr_at(max(self._updates - 1, 0))

    def _set_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * self._lr_at(self._updates)

    def build_critic(self, lr: float) -> None:
        raise NotImplementedError("trainer.backend = 'megatron' has no value model: use trainer.backend = 'fsdp' "
                                  "for PPO")

    def critic_values(self, input_ids, attention_mask):
        raise NotImplementedError("trainer.backend = 'megatron' has no value model")

    def forward_backward(self, micro_batches, loss_fn, request, forward_only=False, around_forward=None):
        chunks = len(self.ddp)
        # The interleaved schedule (virtual stages) takes micro-batches in groups of PP: a short list is
        # filled up with one-row stand-ins whose loss is zero (nothing recorded, no gradient).
        stand_ins = -len(micro_batches) % self.cfg.pipeline_parallel_size if chunks > 1 else 0
        micro_batches = list(micro_batches) + [_StandIn(micro_batches[-1].input_ids[:1])] * stand_ins
        n = len(micro_batches)
        timer = {"fwd": 0.0}
        multiple = _seq_multiple(self.cfg)
        width = max(_pad_to(mb.input_ids, multiple).shape[1] for mb in micro_batches)
        rows = max(mb.input_ids.shape[0] for mb in micro_batches)
        # Between pipeline stages every micro-batch travels at one shape (rows × width): megatron-core's
        # shape exchange for variable lengths does not pair up under the interleaved schedule. The
        # padding rows and positions come after the real ones, so causal attention keeps them apart.
        uniform = self.cfg.pipeline_parallel_size > 1
        self._uniform_shape = (rows, width) if uniform else None  # routing_replay lays routes out the same

        def padded(mb):  # (B, T') the width the schedule splits (SP, CP), one width for a pipeline
            ids = _pad_to(mb.input_ids, multiple)
            return torch.nn.functional.pad(ids, (0, width - ids.shape[1])) if uniform else ids

        def forward_step(data_iterator, model):
            t0 = time.perf_counter()
            mb = next(data_iterator)
            ids = padded(mb)
            if uniform:
                ids = torch.nn.functional.pad(ids, (0, 0, 0, rows - ids.shape[0]))
            ids = local_chunks(ids, 1)  # (B, T'/CP): this CP rank's two chunks
            pos = local_positions(ids.shape[1], ids.device).expand_as(ids)
            replay = around_forward is not None and not isinstance(mb, _StandIn)
            with around_forward(mb) if replay else contextlib.nullcontext():
                out = model(ids, pos, None)
            timer["fwd"] += time.perf_counter() - t0
            return out, functools.partial(self._loss, mb, padded(mb), loss_fn, request, n, timer)

        data = [iter(micro_batches) for _ in range(chunks)] if chunks > 1 else iter(micro_batches)
        t0 = time.perf_counter()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data,
                                    model=self.ddp if chunks > 1 else self.ddp[0], num_microbatches=n,
                                    seq_length=width, micro_batch_size=rows, forward_only=forward_only)
        total = time.perf_counter() - t0
        return timer["fwd"], max(total - timer["fwd"], 0.0)

    def _loss(self, mb, ids, loss_fn, request, n: int, timer: dict, logits: torch.Tensor):
        """Megatron's loss function for one micro-batch: token outputs from the vocabulary-parallel logits
        (B, T', V/t), then the trainer's loss. The schedule divides what this returns by the number of
        micro-batches (and multiplies it by the CP size, undoing DDP's average over the CP ranks); the
        trainer's loss is already a sum over the global batch, so that division is undone here."""
        if isinstance(mb, _StandIn):
            return logits.sum() * 0.0, {}
        t0 = time.perf_counter()
        B, T = mb.input_ids.shape
        logits = logits[:B]  # without the rows a pipeline pads with
        targets = local_chunks(torch.cat([ids[:, 1:], ids[:, :1]], dim=1), 1)  # the last position's is dropped
        out = vocab_parallel_token_outputs(logits, targets, request, mpu.get_tensor_model_parallel_group())

        def whole(t):  # (B, T'/CP) this rank's tokens -> (B, T-1) in sequence order
            return None if t is None else gather_tokens(t, 1)[:, :T - 1]
        tokens = TokenOutputs(whole(out.logprobs), whole(out.entropy),
                              None if out.greedy is None else whole(out.greedy.float()).bool())
        loss = loss_fn(mb, tokens) * n
        timer["fwd"] += time.perf_counter() - t0
        return loss, {}

    def routing_replay(self, mb, replay: bool, sums: dict):
        """R3 around one micro-batch's forward (router_replay.py); a no-op without recorded routes."""
        if mb.routed is None:
            return contextlib.nullcontext()
        own = (mb.input_ids.shape[0], _pad_to(mb.input_ids, _seq_multiple(self.cfg)).shape[1])
        rows, width = self._uniform_shape or own
        engine = engine_ids_in_router_order(mb.routed, width, self.cfg.sequence_parallel, local_chunks, rows)
        return replaying(self.chunks, replay_family(self.hf_config), engine, replay, sums)

    def optimizer_step(self) -> float:
        # megatron-core's step in its own three parts (ChainedOptimizer.step), clipping in between by
        # scaling the gradients here: its clip_grad_by_total_norm_fp32 asserts CUDA tensors.
        self._set_lr()
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())  # over TP, PP, EP and DP, as megatron-core counts it
        clip = self.cfg.grad_clip
        if clip > 0 and norm > clip:
            coef = clip / (norm + 1e-6)
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optimizer.step_with_ready_grads()
        for d in self.ddp:
            d.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._updates += 1
        return float(norm)

    # -- weights out ---------------------------------------------------------------------------
    @torch.no_grad()
    def _hf_groups(self, value=None, chunks=None) -> Iterator[dict[str, torch.Tensor]]:
        """This stage's weights under HF names (of `chunks`, default all), one decoder layer (or the run
        of top-level weights before or after the layers) at a time, in the model's order: TP shards
        gathered within their group, a layer's experts stacked and gathered within their EP group.
        With `value(p)`, a tensor laid out like each parameter instead (an Adam moment). Collective
        over the stage's TP and EP groups; holds one layer's full tensors at a time."""
        group: dict[str, torch.Tensor] = {}
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        current = ()
        for rule, name, layer, p in self._params(chunks):
            if layer != current and (group or experts):
                yield self._with_experts(group, experts)
                group, experts = {}, {}
            current = layer
            full = _gather(p, None if value is None else value(p))
            if rule is None:
                k = int(name.split("local_experts.")[1].split(".")[0])
                if "linear_fc1" in name:
                    full = gate_up_rule("", (), _tp_size(p), stacked=True).to_hf(full)[0]
                experts.setdefault((layer, "fc1" if "linear_fc1" in name else "fc2"), {})[k] = full
                continue
            group.update(zip(rule.hf, rule.to_hf(full)))
        if group or experts:
            yield self._with_experts(group, experts)

    @staticmethod
    def _with_experts(group: dict, experts: dict) -> dict:
        ep_group = mpu.get_expert_model_parallel_group()
        for (layer, which), local in sorted(experts.items()):
            stacked = torch.stack([local[k] for k in sorted(local)])  # (E_local, ...)
            if dist.get_world_size(ep_group) > 1:
                parts = [torch.empty_like(stacked) for _ in range(dist.get_world_size(ep_group))]
                dist.all_gather(parts, stacked.contiguous(), group=ep_group)
                stacked = torch.cat(parts)
            group[expert_names(layer)[0 if which == "fc1" else 1]] = stacked
        return group

    def _hf_tensors(self, value=None) -> dict[str, torch.Tensor]:
        """This pipeline stage's weights (or `value(p)`s) under HF names, all at once."""
        return {k: v for g in self._hf_groups(value) for k, v in g.items()}

    def _all_stages(self, local: dict) -> dict:
        pp_group = mpu.get_pipeline_model_parallel_group()
        if dist.get_world_size(pp_group) > 1:
            stages: list = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(stages, {k: v.to(HOST) for k, v in local.items()}, group=pp_group)
            local = {k: v for stage in stages for k, v in stage.items()}
        return local

    def _groups_of_every_stage(self) -> Iterator[dict[str, torch.Tensor]]:
        """Every stage's `_hf_groups` in the model's order (virtual chunk by chunk, stage by stage), each
        broadcast from its stage over the pipeline group as it is made: its names, shapes and dtypes,
        then its tensors. Collective; a rank holds one layer's full tensors at a time."""
        pp_group = mpu.get_pipeline_model_parallel_group()
        stages = dist.get_world_size(pp_group)
        if stages == 1:
            yield from self._hf_groups()
            return
        mine = mpu.get_pipeline_model_parallel_rank()
        for c in range(len(self.chunks)):
            for stage in range(stages):
                src = dist.get_global_rank(pp_group, stage)
                made = self._hf_groups(chunks=[self.chunks[c]]) if stage == mine else None
                while True:
                    group = next(made, None) if made is not None else None
                    meta = [None if group is None else [(n, t.shape, t.dtype) for n, t in group.items()]]
                    dist.broadcast_object_list(meta, src=src, group=pp_group, device=self.device)
                    if meta[0] is None:
                        break
                    if group is None:
                        group = {n: torch.empty(shape, dtype=dtype, device=self.device) for n, shape, dtype in meta[0]}
                    for name, _, _ in meta[0]:
                        dist.broadcast(group[name].contiguous(), src=src, group=pp_group)
                    yield group

    def named_tensors(self, all_ranks: bool = False, on_device: bool = False):
        seen: set[str] = set()
        for group in self._groups_of_every_stage():
            for name in _hf_order(group):
                if name in seen:
                    continue
                seen.add(name)
                t = group[name]
                yield name, ((t if on_device else t.to(HOST)) if (self.rank == 0 or all_ranks) else None)


@dataclasses.dataclass(frozen=True)
class _StandIn:
    """A micro-batch that fills the interleaved schedule's last group: its loss is zero."""

    input_ids: torch.Tensor


def _is_expert(p) -> bool:
    return getattr(p, "is_expert_weight", False)


def _tp_group(p):
    return mpu.get_expert_tensor_parallel_group() if _is_expert(p) else mpu.get_tensor_model_parallel_group()


def _tp_size(p) -> int:
    return dist.get_world_size(_tp_group(p)) if getattr(p, "tensor_model_parallel", False) else 1


def _shard_of(full: torch.Tensor, p) -> torch.Tensor:
    if not getattr(p, "tensor_model_parallel", False):
        return full
    group = _tp_group(p)
    return full.chunk(dist.get_world_size(group), dim=p.partition_dim)[dist.get_rank(group)]


def _gather(p, t: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor of `p` (or of `t`, laid out like p's shard) over its TP group."""
    t = p.detach() if t is None else t.detach()
    if not getattr(p, "tensor_model_parallel", False) or _tp_size(p) == 1:
        return t.clone()
    group = _tp_group(p)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=p.partition_dim)


def _hf_order(names) -> list[str]:
    """Embeddings, then layer by layer, then the final norm and head: the order HF's state dict has."""
    def key(n: str):
        if n.startswith("model.layers."):
            return (1, int(n.split(".")[2]), n)
        return (0 if "embed" in n else 2, 0, n)
    return sorted(names, key=key)


def _seq_multiple(cfg: TrainerConfig) -> int:
    """Sequence parallelism splits the sequence over TP ranks, context parallelism into 2·CP chunks."""
    m = cfg.tensor_parallel_size if cfg.sequence_parallel else 1
    cp = cfg.context_parallel_size
    return m * 2 * cp if cp > 1 else m


def _pad_to(ids: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -ids.shape[1] % multiple
    return torch.nn.functional.pad(ids, (0, extra)) if extra else ids
