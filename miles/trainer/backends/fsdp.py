"""FSDP2 trainer: one instance per rank, all ranks in one torch.distributed group.

Each decoder layer and the root module are sharded with `fully_shard` (with more than one rank;
a single rank trains the plain module); the optimizer steps on the local shards. A step's loss is a weighted sum of per-token losses whose weights depend only on
counts over the *global* batch (`BatchTotals`), so the gradient is the same whether the samples sit
on one rank or many, in one micro-batch or ten, padded or packed.

The backend is algorithm-blind: it runs the forward passes the algorithm declares (entropy, reference,
critic) and backpropagates the loss that trainer/loss.py composes from them.
With `trainer.quantization`, the policy's Linear layers compute with their weights as that format
stores them (precision/linear.py: quantization-aware training, straight-through gradients).
Around the policy: an optional reference model (KL), an optional frozen teacher (distillation), an
optional value model (PPO), LoRA adapters,
an LR schedule, optimizer-state offload and distributed checkpoints (see the sibling modules).
Tensor/expert parallel layouts come from transformers' distributed config (trainer/parallel.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from miles.models.loading import load_model, load_tokenizer
from miles.models.moe import moe_shape, routers
from miles.precision.linear import quantize_linears
from miles.trainer.algorithms import AlgorithmConfig, get_algorithm
from miles.trainer.batching import build_micro_batch, plan_micro_batches
from miles.trainer.checkpoint import CheckpointWriter, fsync_file, load_trainer_state, save_trainer_state
from miles.trainer.config import TrainerConfig, lr_lambda
from miles.trainer.device import HOST, collective_backend, compute_device, mixed_precision
from miles.trainer.forward import forward_logprobs
from miles.trainer.lora import adapter_tensors, apply_lora, merged_tensors
from miles.trainer.loss import ForwardOutputs, micro_batch_loss, sequence_weights, step_metrics
from miles.trainer.offload import OptimizerSet
from miles.trainer.parallel import load_parallel_model
from miles.trainer.r3 import check_sequences, routing_replay
from miles.trainer.reference import ReferenceModel
from miles.trainer.types import BatchTotals, TrainSequence


class FSDPTrainer:
    def __init__(self, cfg: TrainerConfig, model_path: str, rank: int, world_size: int,
                 master_addr: str, master_port: int, seed: int = 0, temperature: float = 1.0):
        torch.set_num_threads(cfg.num_threads)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        self.device = compute_device(cfg.device, rank)
        if not dist.is_initialized():
            dist.init_process_group(collective_backend(cfg.device, cfg.collective_backend), rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.model_path, self.temperature = model_path, temperature
        self.step = 0
        self.checkpoints = CheckpointWriter(cfg.collective_timeout_s)  # background checkpoint and export writes
        torch.manual_seed(seed)
        self.pad_id = load_tokenizer(model_path).pad_token_id or 0
        self.algorithm = get_algorithm(cfg.algorithm)
        self.model, self.dp_size = self._build_policy()
        self.routers = routers(self.model)  # empty for dense models
        self.moe_shape = moe_shape(self.model.config) if self.routers else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optim = OptimizerSet(params, cfg, lr_lambda(cfg), rank)
        self._algorithms = {None: self.algorithm}
        self.reference = None
        if self.algorithm.needs_reference:
            self.reference = ReferenceModel(model_path)
        self.teacher = None
        if getattr(self.algorithm, "needs_teacher", False) and self.algorithm.teacher_path:
            # A frozen copy of the teacher: loaded once, never refreshed, never sent weights.
            self.teacher = ReferenceModel(self.algorithm.teacher_path)
        self.critic = self.critic_optim = None
        if self.algorithm.needs_critic:
            self._build_critic()

    # -- construction ---------------------------------------------------------------------------
    def _build_policy(self):
        cfg = self.cfg
        if cfg.tensor_parallel_size > 1 or cfg.expert_parallel_size > 1:
            model, dp = load_parallel_model(self.model_path, cfg.tensor_parallel_size, cfg.expert_parallel_size,
                                            self.world_size)
            model.train()
            return model, dp
        model = load_model(self.model_path, "float32")  # float32 master weights, whatever the compute dtype
        quantize_linears(model, cfg.quantization, "train", key="trainer.quantization",  # before sharding
                         embeddings=cfg.quantize_embeddings)
        if cfg.lora.rank:
            model = apply_lora(model, cfg.lora)
        model.to(self.device)
        _shard(model, self.world_size, self.device, mixed_precision(cfg.param_dtype))
        model.train()
        return model, self.world_size

    def _build_critic(self):
        critic = AutoModelForTokenClassification.from_pretrained(self.model_path, num_labels=1, dtype=torch.float32,
                                                                 attn_implementation="sdpa")
        torch.nn.init.zeros_(critic.score.weight)  # start from V = 0 rather than random values
        critic.to(self.device)
        _shard(critic, self.world_size, self.device, mixed_precision(self.cfg.param_dtype))
        critic.train()
        self.critic = critic
        self.critic_optim = torch.optim.AdamW(critic.parameters(), lr=self.algorithm.cfg.critic_lr,
                                              betas=(self.cfg.adam_beta1, self.cfg.adam_beta2))

    # -- one optimizer step -------------------------------------------------------------------
    def train_step(self, seqs, totals, algorithm: str | None = None) -> dict[str, float]:
        """Forward/backward over local micro-batches, then one optimizer step (all ranks call this).

        `totals` (BatchTotals, or the global loss-token count) describes the whole global batch.
        `algorithm` names another algorithm's loss for this step (e.g. "sft"); None = the configured one.
        """
        return self.train_minibatches([(seqs, totals)], algorithm)

    def train_minibatches(self, minibatches, algorithm: str | None = None) -> dict[str, float]:
        """One loop step of several optimizer updates: one per (seqs, totals) minibatch, in order, each
        `totals` describing its minibatch's global batch (all ranks call this with as many minibatches).

        With more than one and an algorithm that reads the proximal policy (decoupled PPO, TIS), every
        sequence's logprobs under the weights at the start of the step are recorded first, in one
        no-grad forward: later minibatches clip and weight against those, not against weights the
        earlier updates already moved. Metrics are means over the minibatches (perf/ seconds: sums)."""
        algo = self._algorithm(algorithm)
        recorded = all(s.prox_logprobs is not None for seqs, _ in minibatches for s in seqs)
        if len(minibatches) > 1 and getattr(algo, "needs_proximal", False) and not recorded:
            t_prox = time.perf_counter()
            flat = self.proximal_logprobs([s for seqs, _ in minibatches for s in seqs], algo)
            it = iter(flat)
            minibatches = [([dataclasses.replace(s, prox_logprobs=next(it)) for s in seqs], totals)
                           for seqs, totals in minibatches]
            prox_s = time.perf_counter() - t_prox
        else:
            prox_s = 0.0
        outs = []
        for seqs, totals in minibatches:
            out = self.compute_gradients(seqs, totals, algorithm)
            t_opt = time.perf_counter()
            out[f"{algo.metric_prefix}/grad_norm"] = self._clip_and_step()
            out["perf/train_optimizer_s"] = time.perf_counter() - t_opt
            outs.append(out)
        self.step += 1
        if len(outs) == 1:
            return outs[0]
        merged = {k: (sum if k.startswith("perf/") else statistics.fmean)([o[k] for o in outs if k in o])
                  for k in outs[0]}
        merged["perf/train_proximal_s"] = prox_s
        merged[f"{algo.metric_prefix}/minibatches"] = float(len(outs))
        return merged

    @torch.no_grad()
    def proximal_logprobs(self, seqs, algorithm=None) -> list[list[float]]:
        """Per sequence, the logprobs of its response tokens under the current weights (collective: every
        rank runs as many forwards). Micro-batched as training is, at the training temperature of
        `algorithm` (None = the configured one)."""
        cfg = self.cfg
        algorithm = algorithm or self.algorithm
        plan = plan_micro_batches([len(s.tokens) for s in seqs], cfg.max_tokens_per_micro_batch,
                                  cfg.micro_batch_size, cfg.pack_sequences)
        n_mb = torch.tensor([len(plan)], device=self.device)
        dist.all_reduce(n_mb, op=dist.ReduceOp.MAX)
        plan += [[]] * (int(n_mb) - len(plan))
        temperature = self.temperature if algorithm.on_rollouts else 1.0
        out: list[list[float] | None] = [None] * len(seqs)
        for members in plan:
            chunk = [seqs[i] for i in members] or [_placeholder(self.pad_id)]
            mb = build_micro_batch(chunk, [0.0] * len(chunk), cfg.pack_sequences, self.pad_id,
                                   self.moe_shape).to(self.device)
            with routing_replay(self.routers, mb.routed, cfg.routing_replay, {}):
                logp, _ = forward_logprobs(self.model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                           temperature)  # (B, T-1)
            logp, sid = logp.float().cpu(), mb.seq_ids.cpu()
            for j, i in enumerate(members):
                out[i] = logp[sid == j].tolist()  # row-major: the sequence's response tokens in order
        return out

    def compute_gradients(self, seqs, totals, algorithm: str | None = None) -> dict[str, float]:
        """Accumulate this rank's share of the step's gradient into .grad (collective); no step."""

        if isinstance(totals, int):
            totals = BatchTotals(loss_tokens=totals, num_seqs=len(seqs), max_response_len=0)
        algo = self._algorithm(algorithm)
        cfg = self.cfg
        if algo.on_rollouts and cfg.routing_replay:
            check_sequences(seqs)
        weights = sequence_weights(algo, seqs, totals, self.dp_size)
        plan = plan_micro_batches([len(s.tokens) for s in seqs], cfg.max_tokens_per_micro_batch,
                                  cfg.micro_batch_size, cfg.pack_sequences)
        # Every rank must run the same number of forward/backward passes (FSDP collectives).
        n_mb = torch.tensor([len(plan)], device=self.device)
        dist.all_reduce(n_mb, op=dist.ReduceOp.MAX)
        plan += [[]] * (int(n_mb) - len(plan))

        self._maybe_refresh_reference()
        sums: dict[str, float] = {}
        if self.moe_shape is not None:
            sums.update(r3_pairs=0.0, r3_mismatch=0.0)  # same keys on every rank for the all-reduce below
        self._fwd_bwd_s = [0.0, 0.0]  # this rank's forward / backward seconds, for the step-time breakdown
        for members in plan:
            if members:
                chunk, w = [seqs[i] for i in members], [weights[i] for i in members]
            else:
                # A rank with nothing left still joins the collectives, with zero weight.
                chunk, w = [_placeholder(self.pad_id)], [0.0]
            mb = build_micro_batch(chunk, w, cfg.pack_sequences, self.pad_id, self.moe_shape).to(self.device)
            self._micro_step(mb, algo, sums, bool(members))
        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(vec)
        # Replicas of one data shard (tensor-parallel peers) counted the same tokens.
        red = dict(zip(keys, (vec / (self.world_size // self.dp_size)).tolist()))
        out = step_metrics(algo, red)
        out[f"{algo.metric_prefix}/lr"] = self.optim.last_lr
        if algo.on_rollouts and red.get("r3_pairs"):
            out[f"{algo.metric_prefix}/r3_mismatch_rate"] = red["r3_mismatch"] / red["r3_pairs"]
        out["perf/train_forward_s"], out["perf/train_backward_s"] = self._fwd_bwd_s
        return out

    def _algorithm(self, name: str | None):
        if name not in self._algorithms:
            self._algorithms[name] = get_algorithm(AlgorithmConfig(name=name))
        return self._algorithms[name]

    def _micro_step(self, mb, algorithm, sums: dict, real: bool) -> None:
        """Run the forward passes the algorithm asks for, then backward on the loss loss.py composes."""
        t_fwd = time.perf_counter()
        temperature = self.temperature if algorithm.on_rollouts else 1.0
        # Mismatch is counted on real micro-batches only; a placeholder carries no routed experts.
        with routing_replay(self.routers, mb.routed, self.cfg.routing_replay, sums):
            logp, entropy = forward_logprobs(self.model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                             temperature, algorithm.needs_entropy)  # (B, T-1)
        out = ForwardOutputs(logp, entropy)
        if algorithm.needs_reference and self.reference is not None:
            out.ref_logprobs = self.reference.logprobs(mb.input_ids, mb.attention_mask, mb.position_ids,
                                                       temperature)
        if getattr(algorithm, "needs_teacher", False) and self.teacher is not None:
            out.teacher_logprobs = self.teacher.logprobs(mb.input_ids, mb.attention_mask, mb.position_ids,
                                                         temperature)
        elif getattr(algorithm, "needs_teacher", False):
            # Teacher engines scored the samples during the rollout (rollout/teacher.py).
            out.teacher_logprobs = mb.teacher_logprobs
        if algorithm.needs_critic and self.critic is not None:
            critic = self.critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
            out.values = critic.logits[:, :-1, 0].float()  # (B, T-1): value of the state before each next token
        loss = micro_batch_loss(algorithm, mb, out, sums, self.dp_size, real)
        t_bwd = time.perf_counter()
        loss.backward()
        self._fwd_bwd_s[0] += t_bwd - t_fwd
        self._fwd_bwd_s[1] += time.perf_counter() - t_bwd

    def _clip_and_step(self) -> float:
        norm = clip_grad_norm([p for p in self.model.parameters() if p.grad is not None], self.cfg.grad_clip)
        self.optim.step()
        self.optim.zero_grad()
        if self.critic is not None:
            clip_grad_norm([p for p in self.critic.parameters() if p.grad is not None], self.cfg.grad_clip)
            self.critic_optim.step()
            self.critic_optim.zero_grad(set_to_none=True)
        return float(norm)

    def _maybe_refresh_reference(self) -> None:
        every = self.cfg.ref_update_every
        if self.reference is not None and every and self.step and self.step % every == 0 \
                and self.reference.version != self.step:
            self.reference.load(self.full_named_tensors(all_ranks=True, merged=True), self.step)

    # -- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def greedy_matches(self, seqs) -> list[bool]:
        """Per sequence: does the argmax at every loss-masked position equal the next token? That is
        exactly whether greedy decoding from the prompt reproduces the demonstrated answer. Every
        rank runs the same micro-batches (FSDP's forward is collective) and returns the same list."""
        self.model.eval()
        out: list[bool] = []
        try:
            for start in range(0, len(seqs), self.cfg.micro_batch_size):
                chunk = seqs[start:start + self.cfg.micro_batch_size]
                mb = build_micro_batch(chunk, [1.0] * len(chunk), False, self.pad_id).to(self.device)
                logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                    use_cache=False).logits[:, :-1]  # (B, T-1, V)
                hit = (logits.argmax(-1) == mb.input_ids[:, 1:]) | (mb.mask == 0)  # (B, T-1)
                out.extend(bool(x) for x in hit.all(-1))
        finally:
            self.model.train()
        return out

    # -- weights out ----------------------------------------------------------------------------
    def full_named_tensors(self, all_ranks: bool = False, merged: bool | None = None,
                           on_device: bool = False) -> Iterator[tuple[str, "object"]]:
        """Full (unsharded) tensors by HF name. Collective: every rank must iterate to the end;
        only rank 0 receives tensors unless `all_ranks` (other ranks get None). They are in host memory,
        or with `on_device` where the trainer computes (a transport that hands GPU memory over).

        With LoRA, `merged` (default: lora.sync = "merged") folds adapters into the base weights;
        otherwise only the adapter tensors are yielded, under PEFT's names."""
        named = self._raw_full_tensors(all_ranks, on_device)
        if not self.cfg.lora.rank:
            yield from named
            return

        if merged is None:
            merged = self.cfg.lora.sync == "merged"
        yield from (merged_tensors(named, self.cfg.lora) if merged else adapter_tensors(named))

    def _raw_full_tensors(self, all_ranks: bool, on_device: bool = False):
        seen: dict[int, str] = {}
        for name, value in self.model.state_dict().items():
            local = value.to_local() if hasattr(value, "to_local") else value
            key = local.untyped_storage().data_ptr() if local.numel() else id(value)
            if key in seen:  # tied weights (embeddings/lm_head) travel once
                continue
            seen[key] = name
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            # Weights leave through host memory, which every transport reads (a no-op on a CPU trainer).
            yield name, ((full.detach() if on_device else full.detach().to(HOST)) if (self.rank == 0 or all_ranks)
                         else None)

    def save_hf(self, out_dir: str, background: bool = False) -> str | None:
        """Export a Hugging Face checkpoint directory (loadable by from_pretrained). Collective: every
        rank gathers; rank 0 writes. LoRA runs export the merged model. With `background` the write
        runs on the checkpoint thread (`checkpoint_written` waits for it); the weights are copied first."""
        state = {n: t.clone() for n, t in self.full_named_tensors(merged=True) if t is not None}
        if self.rank != 0:
            return None
        if background:
            self.checkpoints.submit(write_hf_export, state, self.model_path, out_dir)
        else:
            write_hf_export(state, self.model_path, out_dir)
        return str(Path(out_dir))

    # -- resumable state ------------------------------------------------------------------------
    def save_checkpoint(self, path: str, background: bool = False) -> None:
        """Distributed checkpoint of everything the next step depends on. Collective. With `background`
        it returns once the state is copied, and the write goes on behind the next steps."""
        save_trainer_state(self, path, self.checkpoints)
        if not background:
            self.checkpoints.wait()

    def checkpoint_written(self) -> None:
        """Wait until this rank's background writes (checkpoints, exports) are on disk; raises a failed one's error."""
        self.checkpoints.wait()

    def load_checkpoint(self, path: str) -> None:
        self.checkpoints.wait()
        load_trainer_state(self, path)


def write_hf_export(state: dict, model_path: str, out_dir: str) -> None:
    """Write full weights (HF names) as a checkpoint directory `out_dir` with `model_path`'s config and
    tokenizer. The model is built on the meta device: its weights are `state`'s, never initialised."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"export mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(model_path).save_pretrained(tmp)
    for f in tmp.iterdir():
        fsync_file(f)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # a checkpoint directory appears whole or not at all


def clip_grad_norm(params, max_norm: float) -> float:
    """Global L2 norm of the gradients, clipped to max_norm (0 = measure only).

    Under tensor/expert parallelism gradients are DTensors on different meshes and placements next
    to plain tensors, which torch's clip_grad_norm_ cannot mix; each kind is measured on its own
    and the squares summed."""

    groups: dict[object, list] = {}
    for p in params:
        g = p.grad
        key = (id(g.device_mesh), tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(p)
    sq = 0.0
    for group in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        if hasattr(n, "full_tensor"):
            n = n.full_tensor()
        sq += float(n) ** 2
    total = math.sqrt(sq)
    if max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        with torch.no_grad():
            for group in groups.values():
                for p in group:
                    p.grad.mul_(coef)
    return total


def _shard(model, world_size: int, device: torch.device, mp_policy=None) -> None:
    """FSDP2 over all ranks: each decoder layer, then the root module. A mixed-precision policy
    shards even one rank: FSDP2 is what casts the float32 shards to the compute dtype."""
    if world_size <= 1 and mp_policy is None:
        return  # one rank has nothing to shard: FSDP's hooks and DTensor dispatch would be pure cost
    mesh = init_device_mesh(device.type, (world_size,))
    kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def _decoder_layers(model):
    """The decoder blocks of an HF causal LM (or a PEFT wrapper / token classifier around one)."""
    for name, module in model.named_modules():
        if name.endswith("layers") and hasattr(module, "__len__") and len(module) and \
                type(module).__name__ == "ModuleList":
            return list(module)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def _placeholder(pad_id: int):
    return TrainSequence(tokens=[pad_id, pad_id], prompt_len=1, loss_mask=[0], old_logprobs=[0.0])
