"""Chunked prefill: a long prompt computed a chunk per engine step, between decode steps of the batch.

One long prompt prefilled whole stalls every running row for as long as its forward takes. With the
fast decode (static_kv.py) the model runner hands such a prompt here instead: it waits in `rows`, and
each engine step computes the next `chunk` tokens of the first one into the static cache's staging
slot (decode_forward.DecodeForward.chunk), then the scheduler runs a decode step of the batch. After
its last chunk the row samples its first token, its prompt's KV goes to the prefix cache, and it
moves into a free slot of the batch like any prefilled row.

Taken: rows whose prompt is longer than one chunk (what the prefix cache holds of it is read at the
first chunk, the rest computed), decoding on the base model, asking for neither input logprobs nor routed experts (those
are recorded by the whole-prompt prefill), and not running alone to isolate a failure. A weight
update between two chunks leaves the prompt's KV mixed: the row still decodes (as a running row
whose KV spans an update does) but its KV is never cached.

Non-goals: several prompts chunked at once (they wait their turn, first come first served), chunking
on the eager path.
"""

from __future__ import annotations

import time

import torch

from miles.engine_api.types import FinishReason
from miles.engine.prefix_cache import PrefixCache
from miles.engine.row import Row
from miles.engine.sampler import sample


class ChunkedPrefill:
    def __init__(self, runner, chunk: int):
        self.runner = runner  # the ModelRunner this works for (its model, caches, batch and bookkeeping)
        self.chunk = chunk
        self.rows: list[Row] = []  # admitted, waiting to be prefilled; the first one is in progress
        self._at = 0  # next prompt position of rows[0] to compute (0: not started)
        self._cached = 0  # tokens of rows[0]'s prompt read from the prefix cache
        self._epoch: int | None = None  # weights_epoch of rows[0]'s first chunk

    def take(self, rows: list[Row]) -> list[Row]:
        """Keep the rows to chunk (see the module docstring); returns the others, to prefill whole."""
        runner = self.runner
        keep = []
        for r in rows:
            if (len(r.prefill_ids()) > self.chunk and not r.req.return_routed_experts
                    and r.input_logprob_start() is None and runner.adapter_of(r) is None
                    and r.isolation != "suspect" and r.req.params.max_new_tokens > 0):
                self.rows.append(r)
            else:
                keep.append(r)
        return keep

    def step(self) -> None:
        """Compute the next chunk of the first waiting row; after its last, it joins the batch."""
        runner, row = self.runner, self.rows[0]
        kv = runner.kv
        t0 = time.perf_counter()
        ids = row.prefill_ids()
        done = False
        with runner.model_lock, torch.inference_mode():
            if self._at == 0:
                kv.allocate()
                hit = runner.prefix_cache.match(ids, limit=len(ids) - 1)  # at least one token is computed
                if hit.tokens:
                    kv.load_staging(*PrefixCache.gather(hit))
                self._at = self._cached = hit.tokens
                self._epoch = runner.weights_epoch
            a, b = self._at, min(self._at + self.chunk, len(ids))
            logits = runner.fast.forward.chunk(kv, kv.staging, torch.tensor(ids[a:b], device=runner.device), a)
            self._at = b
            if b == len(ids):
                done = True
                version, whole = runner.weight_version, self._epoch == runner.weights_epoch
                tokens, logprobs = sample(logits[None], [row.req.params], [row.draws], runner._generator)
                if whole and runner.prefix_cache.max_tokens:
                    runner.prefix_cache.insert(ids, lambda x, y: kv.row_kv(kv.staging, x, y))
                if kv.n >= kv.slots:  # retired rows still hold slots: drop them (admission counted only live ones)
                    runner.compact(force=True)
                kv.adopt(len(ids), tokens)
                host = torch.stack([tokens.double(), logprobs.double()]).tolist()
        runner.stats["prefill_forwards"] += 1
        runner.stats["prefill_s"] += time.perf_counter() - t0
        if not done:
            return
        self.rows.pop(0)
        self._at = 0
        if row.cached_tokens is None:
            row.cached_tokens = self._cached
            runner.stats["prompt_tokens"] += len(row.req.input_ids)
            runner.stats["cached_tokens"] += self._cached
        row.kv_version = runner.weights_epoch if whole else None
        runner.rows = runner.rows + [row]
        runner.record([row], [int(host[0][0])], [host[1][0]], version)
        runner.stats["max_running_reqs"] = max(runner.stats["max_running_reqs"], runner.num_running)

    def abort(self, rids: set[str]) -> None:
        for row in self.rows:
            if row.req.rid in rids and row.finish is None:
                row.finish = FinishReason("abort", message="aborted")

    def finished(self) -> list[Row]:
        """Waiting rows that were aborted, taken out and marked answered (the caller answers them)."""
        gone = [r for r in self.rows if r.finish is not None]
        if gone:
            if self.rows[0] in gone:
                self._at = 0
            self.rows = [r for r in self.rows if r.finish is None]
            for r in gone:
                r.answered = True
        return gone

    def clear(self) -> list[Row]:
        """Forget every waiting row (the caller requeues or answers them); returns them."""
        rows, self.rows, self._at = self.rows, [], 0
        return rows

