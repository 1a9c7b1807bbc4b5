"""The global batch of a step and its micro-batches, padded or packed, with per-token training targets.

Rollout groups become a step's batch here (`build_step`): the algorithm's per-group advantages
(re-estimated under the proximal policy for an algorithm that reweights groups), then its batch-wide
pass over the whole global batch, then each minibatch's totals (so the loss does not depend on how
the batch is split over ranks). Every group handed over is trained: dropping groups is the buffer
filter's job, where the ledger counts it.

A micro-batch is either padded rows (one sequence per row, cost = rows × longest row) or one packed
row (sequences end to end, cost = total length). Packed sequences never attend to each other: each
restarts its position ids at 0 and the model builds a block-diagonal causal mask from them.
Padded rows may share their prompts (`SharedPrompts`): a group's samples start with the same prompt,
so the micro-batch carries each distinct prompt once (but its last token) and each row only that
last token and the response; the forward computes the prompts, then the rows on top of their KV.
Non-goal: splitting one sequence over micro-batches (a sequence over budget gets one to itself).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from miles.buffer.types import Group, SampleStatus
from miles.trainer.algorithms.base import Algorithm
from miles.trainer.types import BatchTotals, StepBatch, TrainSequence

if TYPE_CHECKING:
    import torch

    from miles.trainer.packed_attention import Plan

    from miles.trainer.vision import ImageBatch, TrainerVision


def sequences_from_groups(groups: list[Group], algorithm: Algorithm) -> list[TrainSequence]:
    """One sequence per sample, with the algorithm's advantages within its group.

    A group whose rewards are all equal gets zero advantages from the group-relative algorithms: it
    adds no gradient to their policy loss but is still trained (and counted as trained). With
    `mask_truncated`, a truncated sample keeps its place (and its reward in the baseline) but no loss token."""
    mask_truncated = algorithm.cfg.mask_truncated
    seqs = []
    for g in groups:
        for s, adv in zip(g.samples, algorithm.advantages(g.rewards)):
            mask = [0] * len(s.loss_mask) if mask_truncated and s.status is SampleStatus.TRUNCATED else s.loss_mask
            seqs.append(TrainSequence(tokens=s.prompt_ids + s.response_ids, prompt_len=len(s.prompt_ids),
                                      loss_mask=mask, old_logprobs=s.rollout_logprobs, advantage=adv,
                                      routed_experts=s.routed_experts, teacher_logprobs=s.teacher_logprobs,
                                      images=s.images))
    return seqs


def reweight_groups(groups: list[Group], seqs: list[TrainSequence], algorithm) -> tuple[list[TrainSequence], dict]:
    """Advantages re-estimated per group under the proximal policy (`algorithm.reweighted_advantages`),
    from each sequence's recorded proximal logprobs; `seqs` are `sequences_from_groups(groups)`, in order.
    Returns them and the mean shift of the groups' baselines (proximal minus behaviour)."""
    out, shifts, i = [], [], 0
    for g in groups:
        part = seqs[i:i + len(g.samples)]
        i += len(g.samples)
        # Σ over loss tokens of log π_prox − log π_behav, clamped: one near-impossible token must not overflow.
        logw = [max(-20.0, min(20.0, sum(m * (p - b) for m, p, b in zip(s.loss_mask, s.prox_logprobs, s.old_logprobs))))
                for s in part]
        advs = algorithm.reweighted_advantages(g.rewards, logw)
        out += [dataclasses.replace(s, advantage=a) for s, a in zip(part, advs)]
        if part:
            top = max(logw)
            w = [math.exp(lw - top) for lw in logw]
            shifts.append(sum(wi * r for wi, r in zip(w, g.rewards)) / sum(w) - sum(g.rewards) / len(g.rewards))
    shift = sum(shifts) / len(shifts) if shifts else 0.0
    return out, {f"{algorithm.metric_prefix}/group_baseline_shift": shift}


def prepare_global_batch(seqs: list[TrainSequence], algorithm: Algorithm) -> tuple[list[TrainSequence], BatchTotals]:
    """The algorithm's batch-wide advantage pass and the global totals of one step."""
    advs = algorithm.batch_advantages([s.advantage for s in seqs])
    seqs = [dataclasses.replace(s, advantage=a) for s, a in zip(seqs, advs)]
    return seqs, BatchTotals.of(seqs)


def build_step(groups: list[Group], algorithm: Algorithm, minibatches: int,
               score: Callable[[list[TrainSequence]], list[list[float]]]) -> StepBatch:
    """One step's batch from rollout groups: the algorithm's advantages, re-estimated under the proximal
    policy when it `reweights_groups` (from `score`, each sequence's logprobs under the trainer's current
    weights: the ranks' collective forward, called only then), its batch-wide pass, and `minibatches`
    consecutive minibatches of whole groups with their totals."""
    seqs = sequences_from_groups(groups, algorithm)
    metrics: dict[str, float] = {}
    if algorithm.reweights_groups:
        # The advantages read the current policy: its logprobs first (they are then the step's proximal ones).
        seqs = [dataclasses.replace(s, prox_logprobs=p) for s, p in zip(seqs, score(seqs))]
        seqs, metrics = reweight_groups(groups, seqs, algorithm)
    return split_step(seqs, algorithm, minibatch_sizes(groups, minibatches), metrics)


def split_step(seqs: list[TrainSequence], algorithm: Algorithm, sizes: list[int] | None = None,
               metrics: dict[str, float] | None = None) -> StepBatch:
    """A step on sequences carrying per-sample advantages: the batch-wide pass over all of them, then
    consecutive minibatches of `sizes` (None: one), each normalised by its own totals."""
    seqs, _ = prepare_global_batch(seqs, algorithm)
    parts, start = [], 0
    for size in sizes or [len(seqs)]:
        part = seqs[start:start + size]
        start += size
        parts.append((part, BatchTotals.of(part)))
    return StepBatch(parts, metrics or {})


def minibatch_sizes(groups: list[Group], k: int) -> list[int]:
    """Sequences in each of a step's `k` minibatches: consecutive runs of whole groups, as even in groups
    as they divide (fewer minibatches when there are fewer groups). `sequences_from_groups` keeps a
    group's samples together, so a group never straddles two updates."""
    k = max(1, min(k, len(groups)))
    return [sum(len(g.samples) for g in groups[i * len(groups) // k:(i + 1) * len(groups) // k])
            for i in range(k)]


def plan_micro_batches(lengths: list[int], max_tokens: int, max_seqs: int, pack: bool) -> list[list[int]]:
    """Group sequence indices into micro-batches whose token cost stays within `max_tokens`
    (0 = no token budget) and whose size stays within `max_seqs` (padded mode only).

    Longest first, first fit: few micro-batches and little padding, for any input order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    costs: list[tuple[int, int]] = []  # (longest, total) per bin
    for i in order:
        n = lengths[i]
        placed = False
        for b, (longest, total) in enumerate(costs):
            if pack:
                fits = max_tokens <= 0 or total + n <= max_tokens
            else:
                fits = len(bins[b]) < max_seqs and (max_tokens <= 0 or max(longest, n) * (len(bins[b]) + 1) <= max_tokens)
            if fits:
                bins[b].append(i)
                costs[b] = (max(longest, n), total + n)
                placed = True
                break
        if not placed:
            bins.append([i])
            costs.append((n, n))
    return bins


@dataclass
class SharedPrompts:
    """The distinct prompts of a micro-batch whose rows continue them: each prompt but its last token,
    computed once; row b continues prompt `row_prompt[b]` from its last token on."""
    input_ids: "torch.Tensor"        # (G, P) right-padded
    attention_mask: "torch.Tensor"   # (G, P)
    row_prompt: "torch.Tensor"       # (B,) index into the G prompts

    def to(self, device) -> "SharedPrompts":
        return SharedPrompts(self.input_ids.to(device), self.attention_mask.to(device), self.row_prompt.to(device))


def shareable_prompts(seqs: list[TrainSequence]) -> bool:
    """Whether computing each prompt once saves work: some prompt repeats and every prompt has a
    token before its last (the rows start at the prompt's last token)."""
    return all(s.prompt_len >= 2 for s in seqs) and \
        len({tuple(s.tokens[:s.prompt_len - 1]) for s in seqs}) < len(seqs)


def row_length(s: TrainSequence, share: bool) -> int:
    """Tokens of the row a sequence takes in a padded micro-batch: all of it, or from its prompt's
    last token on when prompts are shared."""
    return len(s.tokens) - s.prompt_len + 1 if share else len(s.tokens)


def padded_tokens(seqs: list[TrainSequence], bins: list[list[int]], share: bool) -> int:
    """Tokens the padded micro-batches `bins` (indices into `seqs`) feed the model: rows x longest row,
    and with shared prompts each micro-batch's distinct prompts (but their last token), padded alike."""
    total = 0
    for b in bins:
        total += len(b) * max(row_length(seqs[i], share) for i in b)
        if share:
            prompts = {tuple(seqs[i].tokens[:seqs[i].prompt_len - 1]) for i in b}
            total += len(prompts) * max(len(p) for p in prompts)
    return total


def _share(seqs: list[TrainSequence], pad_id: int):
    """The micro-batch's SharedPrompts and its sequences cut to their rows (prompt_len 1: the prompt's last token)."""
    import torch

    index: dict[tuple[int, ...], int] = {}
    row_prompt = [index.setdefault(tuple(s.tokens[:s.prompt_len - 1]), len(index)) for s in seqs]
    prompts = list(index)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for g, p in enumerate(prompts):
        ids[g, :len(p)] = torch.tensor(p, dtype=torch.long)
        attn[g, :len(p)] = 1
    rows = [dataclasses.replace(s, tokens=s.tokens[s.prompt_len - 1:], prompt_len=1) for s in seqs]
    starts = torch.tensor([len(prompts[g]) for g in row_prompt], dtype=torch.long)  # (B,) position of each row's first token
    return SharedPrompts(ids, attn, torch.tensor(row_prompt, dtype=torch.long)), rows, starts


@dataclass
class MicroBatch:
    input_ids: "torch.Tensor"                # (B, T)
    attention_mask: "torch.Tensor | None"    # (B, T); None when packed
    position_ids: "torch.Tensor | None"      # (1, T) when packed; with images (3, B, T), packed (4, 1, T)
    mask: "torch.Tensor"                     # (B, T-1) 1 on loss tokens
    weights: "torch.Tensor"                  # (B, T-1) aggregation weight of each loss token
    old_logprobs: "torch.Tensor"             # (B, T-1)
    advantages: "torch.Tensor"               # (B, T-1)
    seq_ids: "torch.Tensor"                  # (B, T-1) index into `seqs`, -1 elsewhere
    seqs: list
    routed: "torch.Tensor | None" = None     # (B, T, MoE layers, top_k) engine expert ids, -1 = none (R3)
    teacher_logprobs: "torch.Tensor | None" = None  # (B, T-1) a teacher engine's, when every sequence has them
    prox_logprobs: "torch.Tensor | None" = None     # (B, T-1) the proximal policy's, when every sequence has them
    images: "ImageBatch | None" = None               # pixel values and grids of the sequences' images, in order
    shared: SharedPrompts | None = None              # the prompts the rows continue (input_ids start at their last token)
    packed: "Plan | None" = None                     # where a packed text row's sequences lie, for attention

    def to(self, device) -> "MicroBatch":
        """The same micro-batch on `device` (itself when already there: built on the host, used on a CPU trainer)."""
        if device == self.input_ids.device:
            return self
        moved = {f.name: (v.to(device) if hasattr(v, "to") and f.name != "seqs" else v)  # ImageBatch, SharedPrompts too
                 for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}
        return MicroBatch(**moved)


def build_micro_batch(seqs: list[TrainSequence], weights: list[float], pack: bool, pad_id: int,
                      moe_shape: tuple[int, int] | None = None, vision: "TrainerVision | None" = None,
                      share_prompts: bool = False) -> MicroBatch:
    """Tensors of one micro-batch. Response token j of a sequence starting at offset o sits at
    o + prompt_len + j and is predicted at the position before it. With `moe_shape` (MoE layers,
    top_k) the sequences' routed experts are laid out the same way; with `vision` (a vision-language
    policy) the sequences' images and 3-D positions come with them (trainer/vision.py). With
    `share_prompts` (padded text rows only) and prompts that repeat, each row holds its sequence from
    the prompt's last token on and `shared` the prompts before it."""
    import torch

    if share_prompts and not pack and moe_shape is None and vision is None and all(s.prompt_len >= 2 for s in seqs):
        shared, rows, starts = _share(seqs, pad_id)
        mb = build_micro_batch(rows, weights, False, pad_id)
        width = mb.input_ids.shape[1]
        return dataclasses.replace(mb, seqs=seqs, shared=shared,
                                   position_ids=starts[:, None] + torch.arange(width)[None])  # (B, T)

    if pack:
        rows = [[i for i in range(len(seqs))]]
        width = sum(len(s.tokens) for s in seqs)
    else:
        rows = [[i] for i in range(len(seqs))]
        width = max(len(s.tokens) for s in seqs)
    B = len(rows)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    pos = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros(B, width - 1)
    w = torch.zeros(B, width - 1)
    old = torch.zeros(B, width - 1)
    adv = torch.zeros(B, width - 1)
    sid = torch.full((B, width - 1), -1, dtype=torch.long)
    # Teacher engines scored every sample, or none did (the in-trainer teacher scores at the forward).
    teacher = torch.zeros(B, width - 1) if seqs and all(s.teacher_logprobs is not None for s in seqs) else None
    prox = torch.zeros(B, width - 1) if seqs and all(s.prox_logprobs is not None for s in seqs) else None
    offsets = [(0, 0)] * len(seqs)
    for r, members in enumerate(rows):
        off = 0
        for i in members:
            s = seqs[i]
            L = len(s.tokens)
            ids[r, off:off + L] = torch.tensor(s.tokens, dtype=torch.long)
            attn[r, off:off + L] = 1
            pos[r, off:off + L] = torch.arange(L)
            lo, n = off + s.prompt_len - 1, len(s.loss_mask)
            m = torch.tensor(s.loss_mask, dtype=torch.float32)
            mask[r, lo:lo + n] = m
            w[r, lo:lo + n] = weights[i] * m
            if s.old_logprobs:
                old[r, lo:lo + n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
            adv[r, lo:lo + n] = torch.tensor(s.token_advantages, dtype=torch.float32) \
                if s.token_advantages else s.advantage
            sid[r, lo:lo + n] = i
            if teacher is not None:
                if len(s.teacher_logprobs) != n:
                    raise ValueError(f"a sequence has {n} response tokens but {len(s.teacher_logprobs)} teacher "
                                     "logprobs; the teacher engine must score every response token")
                teacher[r, lo:lo + n] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
            if prox is not None:
                prox[r, lo:lo + n] = torch.tensor(s.prox_logprobs, dtype=torch.float32)
            offsets[i] = (r, off)
            off += L
    routed = None
    if moe_shape is not None:
        from miles.trainer.r3 import routed_tensor  # r3 imports torch; the orchestrator imports this module

        routed = routed_tensor(seqs, offsets, moe_shape, B, width)
    images, mm_pos = vision.batch(seqs, offsets, B, width, pack) if vision is not None else (None, None)
    if pack:
        from miles.trainer.packed_attention import Plan  # imports torch, as this function does

        # Padding to the right would be read as one more packed sequence; there is none here.
        return MicroBatch(ids, None, pos if mm_pos is None else mm_pos, mask, w, old, adv, sid, seqs, routed, teacher,
                          prox, images, packed=Plan.of([len(s.tokens) for s in seqs]) if vision is None else None)
    return MicroBatch(ids, attn, mm_pos, mask, w, old, adv, sid, seqs, routed, teacher, prox, images)
