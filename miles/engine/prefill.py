"""Prefill: computing admitted prompts and sampling their first tokens, for the model runner.

Each prompt starts from the longest cached prefix it holds (prefix_cache.py); identical prompts (on
the same adapter) are computed once and their rows copy the result; whole blocks that several
admitted prompts share and the cache lacks are computed once, ahead of them, so the main forward finds
them cached. Prompts asking for routed experts, and prompts on an adapter other than the default,
read no cache (the cache keeps KV but not routing, and the default adapter's KV only). The new rows
then join the running batch (kv_cache.BatchKV.merge).

Runs on the scheduler's thread, holding the runner's model_lock for the forward, the sampling and
every prefix-cache read or write. Non-goals: long prompts a chunk per step (chunked_prefill.py), the
forward's hooks and masks (ModelRunner.forward), the decode step (model_runner.py).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from miles.engine import kv_cache
from miles.engine.lora import Adapter
from miles.engine.row import Row
from miles.engine_api.types import FinishReason


def prompt_key(runner, row: Row) -> tuple:
    """What makes two rows' prefills one computation: the same prompt on the same resolved adapter.

    The scheduler's admission reads it without model_lock to count its prefill budget, where an adapter
    swapped meanwhile can only miscount the budget of one step."""
    return row.prefill_ids(), id(runner.adapter_of(row))


class Prefill:
    def __init__(self, runner):  # the ModelRunner that owns this Prefill
        self.runner = runner

    def run(self, rows: list[Row]) -> None:
        """Compute `rows`' prompts, sample their first tokens and append the rows to the running batch."""
        runner = self.runner
        # Identical prompts (on the same adapter) are prefilled once; `lead[i]` is the unique prompt row i copies.
        with runner.model_lock, torch.inference_mode():
            uniq: list[tuple[int, ...]] = []
            adapters: list[Adapter | None] = []
            where: dict[tuple, int] = {}
            lead = []
            for r in rows:
                key = prompt_key(runner, r)
                if key not in where:
                    where[key] = len(uniq)
                    uniq.append(key[0])
                    adapters.append(runner.adapter_of(r))
                lead.append(where[key])
            routed_uniq = {lead[i] for i, r in enumerate(rows) if r.req.return_routed_experts}
            private = {lead[i] for i, r in enumerate(rows) if runner.is_private(r)}
            starts: dict[int, int] = {}  # unique prompt -> the earliest position any of its rows scores from
            for r, j in zip(rows, lead):
                k = r.input_logprob_start()
                if k is not None:
                    starts[j] = min(k, starts.get(j, k))
            epoch, version = runner.weights_epoch, runner.weight_version
            computed_by = self.shared_prefixes(uniq, routed_uniq | private)
            cache, mask, logits, cached, routed, scored = self.forward(uniq, routed_uniq, private, adapters, starts)
            for i, before in computed_by.items():
                cached[i] = before  # this prompt paid for the shared prefix; the others reuse it
            if len(uniq) < len(rows):
                idx = torch.tensor(lead, device=runner.device)
                logits, mask = logits[idx], mask[idx]
                kv_cache.select_rows(cache, idx)
            tokens, logprobs = runner.sample_rows(logits, rows)
        for r, j in zip(rows, lead):
            if r.req.return_routed_experts:
                # Its whole prompt was computed (no cache read), right-aligned in the (R, S) suffix block.
                r.routed = [routed[j, routed.shape[1] - len(uniq[j]):]]
        first_of = {}
        for r, j in zip(rows, lead):
            if r.cached_tokens is None:
                # A copy of another row's prompt computed none of its own KV.
                r.cached_tokens = cached[j] if j not in first_of else len(r.req.input_ids)
                runner.stats["prompt_tokens"] += len(r.req.input_ids)
                runner.stats["cached_tokens"] += r.cached_tokens
            first_of.setdefault(j, r)
            r.kv_version = None if j in private else epoch  # KV of a non-default adapter is never cached
            k = r.input_logprob_start()
            if k is not None:
                # The unique prompt was scored from its rows' earliest start; this row's list starts at k.
                r.input_logprobs = [None] + scored[j][k - starts[j]:]
                r.weight_version = version
                if r.req.params.max_new_tokens == 0:  # scoring only: nothing to generate
                    r.finish = FinishReason("length", length=0)
        # (R,) each row's next position: its length, less what its images saved (multimodal.py).
        lens = torch.tensor([len(uniq[j]) + (runner.images.offset(uniq[j]) if runner.images else 0) for j in lead],
                            device=runner.device)
        runner.kv.merge(cache, mask, lens, tokens)
        runner.rows = runner.rows + rows
        runner.record(rows, tokens.tolist(), logprobs.tolist(), version)
        runner.stats["max_running_reqs"] = max(runner.stats["max_running_reqs"], runner.num_running)

    def shared_prefixes(self, uniq: list[tuple[int, ...]], full: set[int] = frozenset()) -> dict[int, int]:
        """Prefill, once, the whole blocks that several admitted prompts start with and the cache lacks
        (a system prompt shared by different questions, the first turns of parallel episodes), so
        the main prefill finds them cached. Returns {prompt index: its cache hit before} for the one
        prompt charged with computing each shared prefix. Prompts in `full` read no cache, so they are
        left out. Caller holds model_lock."""
        runner = self.runner
        B = runner.prefix_cache.block_size
        if len(uniq) < 2 or runner.prefix_cache.max_tokens == 0:
            return {}
        order = sorted(range(len(uniq)), key=lambda i: uniq[i])
        shared_len = [0] * len(uniq)
        for a, b in zip(order, order[1:]):  # in sorted order the longest common prefix is a neighbour's
            n = _common_prefix_len(uniq[a], uniq[b])
            shared_len[a], shared_len[b] = max(shared_len[a], n), max(shared_len[b], n)
        todo: dict[tuple[int, ...], int] = {}
        for i, ids in enumerate(uniq):
            if i in full:
                continue
            n = min(shared_len[i], len(ids) - 1)
            before = runner.prefix_cache.match(ids, limit=n).tokens
            # Worth its own forward only when it saves at least a block's worth of recomputation.
            if n - before >= B and ids[:n] not in todo:
                todo[ids[:n]] = i
        if not todo:
            return {}
        charged = {i: runner.prefix_cache.match(uniq[i], limit=len(uniq[i]) - 1).tokens for i in todo.values()}
        self.forward(list(todo))
        return charged

    def forward(self, prompts: list[tuple[int, ...]], full: set[int] = frozenset(),
                         private: set[int] = frozenset(), adapters: list[Adapter | None] | None = None,
                         starts: dict[int, int] | None = None):
        """One forward over `prompts`, each starting from its cached prefix (prompts in `full`: from
        nothing, recording routed experts; in `private`: from nothing, on an adapter other than the
        default, `adapters[i]`); inserts the new KV into the prefix cache (not the private prompts'). Returns (cache,
        mask (R, M + S), last-position logits (R, V), cached lengths, routed ids (R, S, layers, top_k)
        or None, {i: logprobs of prompt i's tokens starts[i]+1 .. end}). Caller holds model_lock."""
        runner = self.runner
        starts = starts or {}
        # At least one token is always computed: its logits choose the first output token. A prompt
        # scored from position k reads at most k cached tokens, as SGLang does: the cache keeps KV, not
        # the logits the scores need.
        hits = [runner.prefix_cache.match(ids, limit=0 if i in full or i in private
                                        else min(len(ids) - 1, starts.get(i, len(ids))))
                for i, ids in enumerate(prompts)]
        cached = [h.tokens for h in hits]
        suffix = [len(ids) - c for ids, c in zip(prompts, cached)]
        R, M, S = len(prompts), max(cached), max(suffix)
        # Built on the host and moved in one copy each: per-row writes into device tensors would each
        # be a transfer of their own.
        ids_t = torch.full((R, S), runner.pad_token_id, dtype=torch.long)  # (R, S) suffixes, left-padded
        pos = torch.zeros((R, S), dtype=torch.long)
        mask = torch.zeros((R, M + S), dtype=torch.long)  # [pad | cached prefix | pad | suffix]
        for i, ids in enumerate(prompts):
            c, n = cached[i], suffix[i]
            ids_t[i, S - n:] = torch.tensor(ids[c:])
            pos[i, S - n:] = torch.arange(c, len(ids))
            mask[i, M - c:M] = 1
            mask[i, M + S - n:] = 1
        ids_t, pos, mask = (t.to(runner.device, non_blocking=True) for t in (ids_t, pos, mask))
        embeds = deepstack = None
        if runner.images is not None and any(t < 0 for p in prompts for t in p):
            embeds, pos, _, deepstack = runner.images.inputs(prompts, cached, S, runner.weights_epoch, runner.device)
        cache = kv_cache.new_cache(runner.model.config)
        if M:
            kv_cache.load_prefixes(cache, hits, cached, M)
        # Suffixes are right-aligned, so the last `keep` columns hold every position a score needs.
        keep = max([len(prompts[i]) - k for i, k in starts.items()], default=1)
        with deepstack.injected(runner.model) if deepstack is not None else nullcontext():
            kept, routed = runner.forward(ids_t, mask, pos, cache, logits_to_keep=keep, capture=bool(full),
                                         adapters=adapters, last_only=False, embeds=embeds)  # (R, keep, V)
        logits = kept[:, -1, :]
        scored = {i: _token_logprobs(kept[i, keep - len(prompts[i]) + k: keep - 1],
                                     runner.model_ids(prompts[i][k + 1:]))
                  for i, k in starts.items()}
        runner.stats["prefill_forwards"] += 1
        for i, ids in enumerate(prompts):
            if i in private:
                continue
            runner.prefix_cache.insert(ids, lambda a, b, i=i: kv_cache.row_kv(cache, mask, i, a, b))
        return cache, mask, logits, cached, routed, scored



def _token_logprobs(logits: torch.Tensor, tokens) -> list[float]:
    """log softmax(logits[t])[tokens[t]] for each t; logits (T, V). Untempered, as SGLang's input logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()


def _common_prefix_len(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
