"""The training step, the same on every backend: one instance per rank, all ranks driven together.

A step's loss is a weighted sum of per-token losses whose weights depend only on counts over the
*global* batch (`BatchTotals`), so the gradient is the same whether the samples sit on one rank or
many, in one micro-batch or ten, padded or packed. The trainer is algorithm-blind: per micro-batch
it runs the forward passes the algorithm declares (policy logprobs and entropy, reference, teacher,
critic) and backpropagates the loss trainer/loss.py composes from them; per minibatch it takes one
optimizer step; with several minibatches and an algorithm that reads the proximal policy, it first
records every sequence's logprobs under the weights at the start of the step.

Around the policy: an optional reference model (KL, refreshed from the policy every
`trainer.ref_update_every` steps), an optional frozen teacher (distillation), an optional value
model (PPO), LoRA (merged or adapter-only weights out), Rollout Routing Replay (trainer/r3.py),
greedy evaluation, Hugging Face exports and resumable checkpoints.

How the models are laid out over ranks and devices, and how they run, backpropagate and step, is
the backend's (`trainer.backend`, trainer/backends/base.py). Non-goal: anything that depends on the
layout or the device (a backend's) or on Ray (orchestration/actors.py wraps this class).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from miles.devices import cpu_threads
from miles.models.loading import load_tokenizer, read_model_config
from miles.models.vision import is_vision_language
from miles.models.moe import model_routers, moe_shape
from miles.trainer.algorithms import AlgorithmConfig, get_algorithm
from miles.trainer.backends.base import BACKENDS
from miles.trainer.batching import build_micro_batch, padded_tokens, plan_micro_batches, row_length, shareable_prompts
from miles.trainer.checkpoint import CheckpointWriter, host_copy, restore_rng, rng_state
from miles.trainer.config import TrainerConfig
from miles.trainer.export import write_hf_export
from miles.trainer.lora import adapter_tensors, merged_tensors
from miles.trainer.loss import ForwardOutputs, micro_batch_loss, sequence_weights, step_metrics
from miles.trainer.r3 import check_sequences, routing_replay
from miles.trainer.reference import ReferenceModel
from miles.trainer.types import BatchTotals, TokenRequest, TrainSequence
from miles.trainer.vision import TrainerVision


class Trainer:
    def __init__(self, cfg: TrainerConfig, model_path: str, rank: int, world_size: int,
                 master_addr: str, master_port: int, seed: int = 0, temperature: float = 1.0):
        torch.set_num_threads(cpu_threads(cfg.num_threads))
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.model_path, self.temperature = model_path, temperature
        self.step = 0
        self.checkpoints = CheckpointWriter(cfg.collective_timeout_s)  # background checkpoint and export writes
        torch.manual_seed(seed)  # before the backend builds the models: LoRA and critic heads draw from it
        self.pad_id = load_tokenizer(model_path).pad_token_id or 0
        self._placeholder_seq = _placeholder(self.pad_id)  # the micro-batch of a rank with nothing left
        self.algorithm = get_algorithm(cfg.algorithm)
        self.backend = BACKENDS.get(cfg.backend)(cfg, model_path, rank, world_size, master_addr, master_port)
        # None for dense models. A backend whose modules are not HF's gives the HF config it was built from.
        self.moe_shape = moe_shape(getattr(self.backend, "hf_config", None) or self.backend.model.config)
        # A vision-language policy's image inputs for micro-batches (trainer/vision.py); None for text.
        self.vision = TrainerVision(model_path) if is_vision_language(read_model_config(model_path)) else None
        self._algorithms = {None: self.algorithm}
        self.reference = None
        if self.algorithm.needs_reference:
            self.reference = ReferenceModel(model_path)
        self.teacher = None
        if self.algorithm.needs_teacher and self.algorithm.teacher_path:
            # A frozen copy of the teacher: loaded once, never refreshed, never sent weights.
            self.teacher = ReferenceModel(self.algorithm.teacher_path)
        if self.algorithm.needs_critic:
            self.backend.build_critic(self.algorithm.cfg.critic_lr)

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
        if len(minibatches) > 1 and algo.needs_proximal and not recorded:
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
            out[f"{algo.metric_prefix}/grad_norm"] = self.backend.optimizer_step()
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
        algorithm = algorithm or self.algorithm
        pack, share = self._layout(seqs, algorithm)
        plan = self._plan(seqs, share, pack)
        temperature = self.temperature if algorithm.on_rollouts else 1.0
        out: list[list[float] | None] = [None] * len(seqs)
        mbs = [self._micro_batch(seqs, members, [0.0] * len(seqs), share, pack) for members in plan]
        members_of = {id(mb.seqs): members for mb, members in zip(mbs, plan)}

        def record(mb, tokens):
            logp, sid = tokens.logprobs.float().cpu(), mb.seq_ids.cpu()
            for j, i in enumerate(members_of[id(mb.seqs)]):
                out[i] = logp[sid == j].tolist()  # row-major: the sequence's response tokens in order
            return tokens.logprobs.sum() * 0.0

        self.backend.forward_backward(mbs, record, TokenRequest(temperature), forward_only=True,
                                      around_forward=self._replay({}))
        return out

    def compute_gradients(self, seqs, totals, algorithm: str | None = None) -> dict[str, float]:
        """Accumulate this rank's share of the step's gradient into .grad (collective); no step."""

        if isinstance(totals, int):
            totals = BatchTotals(loss_tokens=totals, num_seqs=len(seqs), max_response_len=0)
        algo = self._algorithm(algorithm)
        cfg = self.cfg
        if algo.on_rollouts and cfg.routing_replay:
            check_sequences(seqs)
        weights = sequence_weights(algo, seqs, totals, self.backend.dp_size)
        pack, share = self._layout(seqs, algo)
        plan = self._plan(seqs, share, pack)

        self._maybe_refresh_reference()
        sums: dict[str, float] = {}
        if self.moe_shape is not None:
            sums.update(r3_pairs=0.0, r3_mismatch=0.0)  # same keys on every rank for the all-reduce below
        mbs = [self._micro_batch(seqs, members, weights, share, pack) for members in plan]

        def loss_fn(mb, tokens):
            return self._micro_loss(mb, tokens, algo, sums, mb.seqs[0] is not self._placeholder_seq)

        fwd_s, bwd_s = self.backend.forward_backward(
            mbs, loss_fn, TokenRequest(self.temperature if algo.on_rollouts else 1.0, algo.needs_entropy),
            around_forward=self._replay(sums))
        # A pipeline's earlier stages computed no loss: every rank all-reduces the keys any rank has.
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(sums))
        for k in set().union(*gathered):
            sums.setdefault(k, 0.0)
        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.backend.device)
        dist.all_reduce(vec)
        # Ranks that compute the same tokens' loss (tensor-parallel peers) counted them alike.
        red = dict(zip(keys, (vec / self.backend.loss_copies).tolist()))
        out = step_metrics(algo, red)
        out[f"{algo.metric_prefix}/lr"] = self.backend.last_lr
        if algo.on_rollouts and red.get("r3_pairs"):
            out[f"{algo.metric_prefix}/r3_mismatch_rate"] = red["r3_mismatch"] / red["r3_pairs"]
        out["perf/train_forward_s"], out["perf/train_backward_s"] = fwd_s, bwd_s
        return out

    def _layout(self, seqs, algorithm) -> tuple[bool, bool]:
        """(pack, share) of this rank's micro-batches. trainer.pack_sequences true: packed rows; false:
        padded rows, sharing prompts where `_shares_prompts` allows; "auto": packed rows where the
        backend attends them a sequence at a time and they feed the model fewer tokens than those padded
        rows would (batching.padded_tokens), else the padded rows."""
        cfg = self.cfg
        if cfg.pack_sequences is True:
            return True, False
        share = self._shares_prompts(seqs, algorithm)
        if cfg.pack_sequences != "auto" or not getattr(self.backend, "packs_by_plan", False) or \
                self.vision is not None or algorithm.needs_critic or not seqs:
            return False, share
        bins = plan_micro_batches([row_length(s, share) for s in seqs], cfg.max_tokens_per_micro_batch,
                                  cfg.micro_batch_size, False)
        if sum(len(s.tokens) for s in seqs) < padded_tokens(seqs, bins, share):
            return True, False
        return False, share

    def _shares_prompts(self, seqs, algorithm) -> bool:
        """Whether this rank's micro-batches compute each prompt once for the rows continuing it
        (trainer.share_prompts): prompts repeat, the backend can, and no other forward of the step
        (reference, in-trainer teacher, critic) reads the micro-batch's whole sequences."""
        others = (algorithm.needs_reference and self.reference is not None) or \
            (algorithm.needs_teacher and self.teacher is not None) or algorithm.needs_critic
        # A backend shares on one rank only (fsdp.py says why), so no rank's forwards differ from another's.
        return self.cfg.share_prompts and self.cfg.pack_sequences is not True and not others and \
            getattr(self.backend, "shares_prompts", False) and shareable_prompts(seqs)

    def _plan(self, seqs, share: bool = False, pack: bool = False) -> list[list[int]]:
        """This rank's micro-batches, padded with empty ones to the most any rank has: every rank must
        run the same number of forward/backward passes (the backend's collectives). With shared prompts
        a row's cost is its response and its prompt's last token."""
        cfg = self.cfg
        plan = plan_micro_batches([row_length(s, share) for s in seqs], cfg.max_tokens_per_micro_batch,
                                  cfg.micro_batch_size, pack)
        n_mb = torch.tensor([len(plan)], device=self.backend.device)
        dist.all_reduce(n_mb, op=dist.ReduceOp.MAX)
        return plan + [[]] * (int(n_mb) - len(plan))

    def _algorithm(self, name: str | None):
        if name not in self._algorithms:
            self._algorithms[name] = get_algorithm(AlgorithmConfig(name=name))
        return self._algorithms[name]

    @functools.cached_property
    def routers(self):
        """The policy's routers with their families (models/routers.py), found on first use: a model
        whose routers R3 cannot replay trains as long as no batch carries routed experts."""
        return model_routers(self.backend.model)

    def _routers(self, mb):
        return self.routers if mb.routed is not None else []

    def _micro_batch(self, seqs, members: list[int], weights: list[float], share: bool = False,
                     pack: bool = False):
        """The micro-batch of `seqs[i] for i in members`; a rank with nothing left still joins the
        collectives, with a placeholder of zero weight."""
        if members:
            chunk, w = [seqs[i] for i in members], [weights[i] for i in members]
        else:
            chunk, w = [self._placeholder_seq], [0.0]
        return build_micro_batch(chunk, w, pack, self.pad_id, self.moe_shape,
                                 self.vision, share).to(self.backend.device)

    def _replay(self, sums: dict):
        """R3 around each micro-batch's forward (a no-op without routers or routes). Mismatch is counted
        on real micro-batches only; a placeholder carries no routed experts."""
        own = getattr(self.backend, "routing_replay", None)  # a backend with routers of its own (Megatron's)
        if own is not None:
            return lambda mb: own(mb, self.cfg.routing_replay, sums)
        return lambda mb: routing_replay(self._routers(mb), mb.routed, self.cfg.routing_replay, sums)

    def _micro_loss(self, mb, tokens, algorithm, sums: dict, real: bool):
        """The loss loss.py composes from the policy's token outputs and the forward passes the algorithm
        asks for besides (reference, teacher, critic)."""
        temperature = self.temperature if algorithm.on_rollouts else 1.0
        out = ForwardOutputs(tokens.logprobs, tokens.entropy)
        if algorithm.needs_reference and self.reference is not None:
            out.ref_logprobs = self.reference.logprobs(mb.input_ids, mb.attention_mask, mb.position_ids,
                                                       temperature, mb.images, mb.packed)
        if algorithm.needs_teacher and self.teacher is not None:
            out.teacher_logprobs = self.teacher.logprobs(mb.input_ids, mb.attention_mask, mb.position_ids,
                                                         temperature, mb.images, mb.packed)
        elif algorithm.needs_teacher:
            # Teacher engines scored the samples during the rollout (rollout/teacher.py).
            out.teacher_logprobs = mb.teacher_logprobs
        if algorithm.needs_critic and self.backend.critic is not None:
            out.values = self.backend.critic_values(mb.input_ids, mb.attention_mask)  # (B, T-1)
        return micro_batch_loss(algorithm, mb, out, sums, self.backend.dp_size, real)

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
        rank runs the same micro-batches (the backend's forward is collective) and returns the same list."""
        model = self.backend.model
        model.eval()
        hits: dict[int, list[bool]] = {}
        mbs = [build_micro_batch(seqs[start:start + self.cfg.micro_batch_size],
                                 [1.0] * len(seqs[start:start + self.cfg.micro_batch_size]), False, self.pad_id,
                                 vision=self.vision).to(self.backend.device)
               for start in range(0, len(seqs), self.cfg.micro_batch_size)]

        def record(mb, tokens):
            hit = tokens.greedy | (mb.mask == 0)  # (B, T-1)
            hits[id(mb.seqs)] = [bool(x) for x in hit.all(-1)]
            return tokens.logprobs.sum() * 0.0

        try:
            self.backend.forward_backward(mbs, record, TokenRequest(1.0, greedy=True), forward_only=True)
        finally:
            model.train()
        return [h for mb in mbs for h in hits[id(mb.seqs)]]

    # -- weights out ----------------------------------------------------------------------------
    def full_named_tensors(self, all_ranks: bool = False, merged: bool | None = None,
                           on_device: bool = False) -> Iterator[tuple[str, "object"]]:
        """Full (unsharded) tensors by HF name. Collective: every rank must iterate to the end;
        only rank 0 receives tensors unless `all_ranks` (other ranks get None). They are in host memory,
        or with `on_device` where the trainer computes (a transport that hands GPU memory over).

        With LoRA, `merged` (default: lora.sync = "merged") folds adapters into the base weights;
        otherwise only the adapter tensors are yielded, under PEFT's names."""
        named = self.backend.named_tensors(all_ranks, on_device)
        if not self.cfg.lora.rank:
            yield from named
            return

        if merged is None:
            merged = self.cfg.lora.sync == "merged"
        yield from (merged_tensors(named, self.cfg.lora) if merged else adapter_tensors(named))

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
        local = {"step": self.step, **rng_state()}
        if self.reference is not None and self.reference.version:
            local["reference"] = host_copy(self.reference.state_dict())  # a refresh must not change what is written
        self.backend.save_state(path, self.checkpoints, local)
        if not background:
            self.checkpoints.wait()

    def checkpoint_written(self) -> None:
        """Wait until this rank's background writes (checkpoints, exports) are on disk; raises a failed one's error."""
        self.checkpoints.wait()

    def load_checkpoint(self, path: str) -> None:
        self.checkpoints.wait()
        local = self.backend.load_state(path)
        self.step = local["step"]
        restore_rng(local)
        if "reference" in local and self.reference is not None:
            self.reference.load_state_dict(local["reference"])


def _placeholder(pad_id: int):
    return TrainSequence(tokens=[pad_id, pad_id], prompt_len=1, loss_mask=[0], old_logprobs=[0.0])
