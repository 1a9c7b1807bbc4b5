"""The built-in engine: a Hugging Face causal LM behind a continuous-batching scheduler with a prefix cache.

One background thread owns the running batch and its KV cache (an HF DynamicCache whose rows are
aligned on the right; masked columns are padding). Each iteration it
  1. admits waiting requests (up to max_batch_size). Each prompt first takes the longest chain of
     cached blocks it starts with from the prefix cache (prefix_cache.py), then only the rest is
     prefilled, all admitted prompts in one forward; identical prompts (the n samples of a GRPO
     group) are prefilled once and share that KV. The fresh KV is inserted into the prefix cache;
  2. runs one decode forward of shape (B, 1) for every running row;
  3. evicts rows that finished (EOS, stop token, stop string, max_new_tokens, context length, abort)
     at once, so a finished sequence frees its slot for the next step, and caches their prompt +
     completion KV so the next turn of a multi-turn episode starts from it.
Every forward, the sampling after it and every prefix-cache read or write run while holding
`model_lock`; a weight update takes the same lock, so weights only ever change between two steps and
no step sees a half-applied set. A weight update empties the prefix cache: KV computed by old weights
is never reused by a request that starts under new ones.

Logprob convention (details in sampler.py): each sampled token's logprob is taken from
log_softmax(logits / T) in float32 for T > 0, or log_softmax(logits) for greedy (T == 0), BEFORE any
top-k / top-p / min-p truncation, which is what the trainer recomputes teacher-forced.
Each output records the weight version that produced its last token (read under the lock, so it
cannot disagree with the weights).
Requests in flight across an update continue on the new weights with the KV cache they already have.

Routed experts (MoE models, `return_routed_experts`): every forward that serves such a request
records each router's top-k ids (models/moe.py), and the request collects the rows of its own tokens:
the prefill's for its prompt, one per decode step after. Such a request computes its whole prompt
rather than reading cached KV, because the cache keeps KV but not the routing that produced it; its
KV is still offered to the cache for requests that do not ask.

Pausing (SGLang's pause modes): `abort` finishes everything in flight as aborted; `retract` puts
running requests back in the queue (their KV goes to the prefix cache, so resuming re-prefills little)
and they continue after /continue_generation; `in_place` stops stepping and keeps the running batch
and its KV as they are. New requests queue while paused.
Non-goals: paged attention, tensor parallelism, speculative decoding.
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import tempfile
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from miles.models.loading import load_model, load_tokenizer
from miles.models.moe import encode_routed_experts, hook_routers, routers
from miles.rollout.engine.config import EngineConfig
from miles.rollout.engine.prefix_cache import PrefixCache
from miles.rollout.engine.sampler import SamplingParams, sample
from miles.rollout.engine.types import (MEMORY_TAGS, PAUSE_MODES, FinishReason, GenerateRequest, GenerateResult,
                                        InvalidRequest)
from miles.rollout.engine.weight_receiver import WeightReceiver

log = logging.getLogger(__name__)


@dataclass
class _Row:
    """A request from submission to result; it may leave the running batch and come back (retract)."""

    req: GenerateRequest
    future: Future
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    weight_version: int | None = None  # version of the weights that produced the latest token
    weight_versions: list[int] = field(default_factory=list)  # every version that produced a token, in order
    cached_tokens: int | None = None  # prompt tokens whose KV came from the cache, set at first admission
    answered: bool = False  # its future is resolved; it may still occupy a row of the batch tensors
    kv_version: int | None = None  # weight version its KV was computed under; None once mixed
    routed: list[torch.Tensor] = field(default_factory=list)  # (tokens, MoE layers, top_k) chunks, in order

    def prefill_ids(self) -> tuple[int, ...]:
        # After a retract the generated tokens are part of what must be prefilled again.
        return self.req.input_ids + tuple(self.output_ids)


class Engine:
    def __init__(self, config: EngineConfig):
        torch.set_num_threads(config.num_threads)
        self.config = config
        self.model = load_model(config.model_path, dtype=config.dtype).eval()
        self.tokenizer = load_tokenizer(config.model_path)
        mcfg = self.model.config
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.context_length = config.context_length or mcfg.max_position_embeddings
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # Names and shapes are fixed for the engine's life; weight updates are validated against them.
        self.param_meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            n: (tuple(t.shape), t.dtype) for n, t in self.model.state_dict().items()}
        self._cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"
        _check_cache_layout(self.model.config)
        self.routers = routers(self.model)  # empty for dense models
        self.prefix_cache = PrefixCache(config.prefix_block_size,
                                        _cache_tokens(config, self.model) if config.prefix_cache else 0)
        self.weight_version = 0
        self.receiver = WeightReceiver(self, timeout_s=config.weight_update_timeout_s)
        self.model_lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting: deque[_Row] = deque()
        self._aborts: set[str] = set()  # rids to abort at the next step; only ever rids in flight
        self._inflight: set[str] = set()  # rids admitted to the running batch and not yet finished
        self._generator = torch.Generator().manual_seed(config.seed)
        self._stopping = False
        self._paused = False  # set by /pause_generation, cleared by /continue_generation
        self._released: set[str] = set()  # memory tags released; generation waits while non-empty
        self._offload_path: str | None = None
        self._control: list[tuple[str, threading.Event]] = []  # quiesce requests for the scheduler
        # Monotonic counters, written by the scheduler thread only (perf/ metrics, batching checks).
        self.stats = {"prefill_forwards": 0, "decode_forwards": 0, "generated_tokens": 0, "max_running_reqs": 0,
                      "prompt_tokens": 0, "cached_tokens": 0, "retracted_reqs": 0, "busy_s": 0.0}
        # Running batch; only the scheduler thread touches these.
        self._rows: list[_Row] = []
        self._dead = 0  # finished rows still in the batch tensors (see _evict_finished)
        self._cache = None
        self._mask: torch.Tensor | None = None  # (B, L) 1 = real token
        self._next_pos: torch.Tensor | None = None  # (B,) position of the next input token
        self._last_tokens: torch.Tensor | None = None  # (B,) next input token
        self._thread = threading.Thread(target=self._loop, name="miles-engine-scheduler", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------

    def make_request(self, input_ids, params: SamplingParams | None = None, return_logprob: bool = False,
                     rid: str | None = None, return_routed_experts: bool = False) -> GenerateRequest:
        """Build a request and check it against this model; raises InvalidRequest naming the field."""
        params = params or SamplingParams(max_new_tokens=self.config.default_max_new_tokens)
        ids = tuple(input_ids)
        if not ids:
            raise InvalidRequest("input_ids: the prompt is empty; send at least one token")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"input_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.context_length:
            raise InvalidRequest(f"input_ids: the prompt has {len(ids)} tokens but the context length is "
                                 f"{self.context_length}; shorten the prompt")
        if params.max_new_tokens > self.context_length:
            raise InvalidRequest(f"sampling_params.max_new_tokens: {params.max_new_tokens} exceeds the context "
                                 f"length {self.context_length}")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"sampling_params.stop_token_ids: {bad} is outside the vocabulary")
        if return_routed_experts and not self.routers:
            raise InvalidRequest("return_routed_experts: this model has no mixture-of-experts layers, so there are "
                                 "no routed experts to return; send false")
        return GenerateRequest(rid=rid or uuid.uuid4().hex, input_ids=ids, params=params,
                               return_logprob=return_logprob, return_routed_experts=return_routed_experts)

    def submit(self, req: GenerateRequest) -> Future:
        """Queue a request; the future resolves to a GenerateResult."""
        fut: Future = Future()
        row = _Row(req, fut, _request_generator(req.params))
        if req.params.max_new_tokens == 0:
            fut.set_result(self._result(row, FinishReason("length", length=0)))
            return fut
        with self._cond:
            if self._stopping:
                fut.set_result(self._result(row, FinishReason("abort", message="engine stopped")))
                return fut
            self._waiting.append(row)
            self._cond.notify()
        return fut

    def generate(self, input_ids, params: SamplingParams | None = None, return_logprob: bool = False,
                 rid: str | None = None, timeout: float | None = None) -> GenerateResult:
        return self.submit(self.make_request(input_ids, params, return_logprob, rid)).result(timeout)

    def abort(self, rid: str | None = None) -> None:
        """Abort one request by id, or every request when rid is None; they finish with type abort and
        keep whatever they generated so far."""
        with self._cond:
            keep = deque()
            for row in self._waiting:
                if rid is None or row.req.rid == rid:
                    row.future.set_result(self._result(row, FinishReason("abort", message="aborted")))
                else:
                    keep.append(row)
            self._waiting = keep
            # Only rids in flight now: a stale entry would abort a later request that reuses the id.
            self._aborts |= set(self._inflight) if rid is None else {rid} & self._inflight
            self._cond.notify()

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cond:
            return len(self._rows) - self._dead, len(self._waiting)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def released(self) -> tuple[str, ...]:
        return tuple(sorted(self._released))

    def pause(self, mode: str = "abort", timeout: float = 120.0) -> None:
        """Stop generating; returns once no forward is running and `mode` has been carried out."""
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode: {mode!r} is not a pause mode; use one of {list(PAUSE_MODES)}")
        with self._cond:
            self._paused = True
            if mode == "abort":
                self.abort(None)
        self._quiesce(mode, timeout)

    def continue_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def release_memory(self, tags: tuple[str, ...] = MEMORY_TAGS, timeout: float = 120.0) -> None:
        """Free the weights and/or the KV (running batch and prefix cache) until resume_memory.

        Running requests are retracted and resume afterwards; new requests queue. Weights go to a
        file (config.offload_dir) because a CPU engine has no other memory to park them in.
        """
        tags = _check_tags(tags)
        with self._cond:
            self._released.update(tags)
        self._quiesce("retract", timeout)
        with self.model_lock:
            if "kv_cache" in tags:
                self.prefix_cache.clear()
            if "weights" in tags and self._offload_path is None:
                from safetensors.torch import save_file

                fd, path = tempfile.mkstemp(prefix="miles-engine-weights-", suffix=".safetensors",
                                            dir=self.config.offload_dir)
                os.close(fd)
                params = dict(self.model.named_parameters())  # tied weights appear once
                save_file({n: p.data.contiguous() for n, p in params.items()}, path)
                for p in params.values():
                    p.data = torch.empty(0, dtype=p.dtype)
                self._offload_path = path
            if "weights" in tags:
                self.receiver.drop_spares()
        _return_freed_memory()

    def resume_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        tags = _check_tags(tags)
        with self.model_lock:
            if "weights" in tags and self._offload_path is not None:
                from safetensors.torch import load_file

                loaded = load_file(self._offload_path)
                for n, p in self.model.named_parameters():
                    p.data = loaded[n]
                os.unlink(self._offload_path)
                self._offload_path = None
        with self._cond:
            self._released.difference_update(tags)
            self._cond.notify()

    def flush_cache(self) -> None:
        """Drop every cached prefix; running requests keep their own KV."""
        with self.model_lock:
            self.prefix_cache.clear()

    def apply_weights(self, tensors: dict[str, torch.Tensor], weight_version: int | None,
                      adopt: frozenset[str] | set[str] = frozenset()) -> tuple[int, list[torch.Tensor]]:
        """Install `tensors` between two decode steps; returns (new weight version, displaced memory).

        A tensor named in `adopt` is held by nobody but the caller, so its parameter takes over its
        memory instead of copying from it: an update then costs no second pass over the weights. The
        parameter's previous memory is returned so the caller can receive the next update into it.
        Everything else (and any dtype or layout mismatch) is copied in place.
        """
        with self.model_lock, torch.no_grad():
            if self._offload_path is not None:
                raise InvalidRequest("the engine's weights are released; call /resume_memory_occupation "
                                     "before updating them")
            state = self.model.state_dict()  # shares storage with the parameters; tied weights share too
            params = dict(self.model.named_parameters(remove_duplicate=False))  # tied names: one Parameter
            displaced = []
            for name, t in tensors.items():
                p = params.get(name)
                if (name in adopt and p is not None and t.dtype == p.dtype and t.shape == p.shape
                        and t.is_contiguous() and p.data.is_contiguous()):
                    displaced.append(p.data)
                    p.data = t
                else:
                    state[name].copy_(t)
            self.weight_version = weight_version if weight_version is not None else self.weight_version + 1
            self.prefix_cache.clear()
            return self.weight_version, displaced

    def covers_parameters(self, names) -> bool:
        """Whether `names` reach every parameter (tied ones through any of their names)."""
        names = set(names)
        reached = {id(p) for n, p in self.model.named_parameters(remove_duplicate=False) if n in names}
        return all(id(p) in reached for p in self.model.parameters())

    def points_into(self, buf: torch.Tensor) -> bool:
        """Whether any parameter or buffer of the model lives in `buf`'s memory."""
        lo = buf.data_ptr()
        hi = lo + buf.numel() * buf.element_size()
        return any(lo <= t.data_ptr() < hi for t in self.model.state_dict().values() if t.numel())

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)
        self.receiver.close()
        if self._offload_path is not None:
            os.unlink(self._offload_path)
            self._offload_path = None

    # ---- scheduler --------------------------------------------------------------------------

    def _quiesce(self, mode: str, timeout: float) -> None:
        done = threading.Event()
        with self._cond:
            self._control.append((mode, done))
            self._cond.notify()
        if not done.wait(timeout):
            raise RuntimeError(f"the scheduler did not pause within {timeout}s")

    def _held(self) -> bool:
        return self._paused or bool(self._released)

    def _loop(self) -> None:
        # OpenMP thread counts are per calling thread: without this the scheduler thread would use
        # the default (every core) and fight the other processes on the machine.
        torch.set_num_threads(self.config.num_threads)
        while True:
            with self._cond:
                while not (self._stopping or self._control or self._aborts
                           or (not self._held() and (self._waiting or self._rows))):
                    self._cond.wait()
                if self._stopping:
                    break
                control, self._control = self._control, []
                aborts, self._aborts = self._aborts, set()
                admit = []
                if not self._held() and not control:
                    room = self.config.max_batch_size - (len(self._rows) - self._dead)
                    admit = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                    self._inflight.update(row.req.rid for row in admit)
            t0 = time.perf_counter()
            try:
                if admit:
                    self._prefill(admit)
                    self._evict_finished()
                # After admission, so an abort that raced with it still finds its row.
                self._apply_aborts(aborts)
                if control:
                    if any(mode == "retract" for mode, _ in control):
                        self._retract_all()
                    for _, done in control:
                        done.set()
                    continue
                if self._rows and not self._held():
                    self._decode_step()
                    self._evict_finished()
                self.stats["busy_s"] += time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
                log.exception("engine step failed; failing the running batch")
                for row in self._rows + admit:
                    if not row.future.done():
                        row.future.set_exception(exc)
                self._reset_batch()
                with self._cond:
                    self._inflight.clear()
                for _, done in control:
                    done.set()
        self._shutdown()

    def _apply_aborts(self, aborts: set[str]) -> None:
        if not aborts:
            return
        for row in self._rows:
            if row.req.rid in aborts and row.finish is None:
                row.finish = FinishReason("abort", message="aborted")
        self._evict_finished()

    def _forward(self, input_ids, mask, position_ids, cache, logits_to_keep: int, capture: bool = False):
        """Last-position logits (B, V), and with `capture` the routed expert ids (B, S, MoE layers, top_k)."""
        kwargs = {self._cache_kwarg: cache}
        ids: list[torch.Tensor] = []
        with hook_routers(self.routers if capture else [], lambda _layer, out: ids.append(out[2])):
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                             logits_to_keep=logits_to_keep, **kwargs)
        routed = None
        if capture:
            B, S = input_ids.shape
            routed = torch.stack(ids, dim=1).to(torch.int32).view(B, S, len(ids), -1)  # each was (B*S, top_k)
        return out.logits[:, -1, :], routed

    def _prefill(self, rows: list[_Row]) -> None:
        # Identical prompts are prefilled once; `lead[i]` is the unique prompt row i copies.
        uniq: list[tuple[int, ...]] = []
        where: dict[tuple[int, ...], int] = {}
        lead = []
        for r in rows:
            ids = r.prefill_ids()
            if ids not in where:
                where[ids] = len(uniq)
                uniq.append(ids)
            lead.append(where[ids])
        routed_uniq = {lead[i] for i, r in enumerate(rows) if r.req.return_routed_experts}
        with self.model_lock, torch.inference_mode():
            version = self.weight_version
            computed_by = self._prefill_shared_prefixes(uniq, routed_uniq)
            cache, mask, logits, cached, routed = self._prefill_forward(uniq, routed_uniq)
            for i, before in computed_by.items():
                cached[i] = before  # this prompt paid for the shared prefix; the others reuse it
            if len(uniq) < len(rows):
                idx = torch.tensor(lead)
                logits, mask = logits[idx], mask[idx]
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[idx], layer.values[idx]
            tokens, logprobs = self._sample(logits, rows)
        for r, j in zip(rows, lead):
            if r.req.return_routed_experts:
                # Its whole prompt was computed (no cache read), right-aligned in the (R, S) suffix block.
                r.routed = [routed[j, routed.shape[1] - len(uniq[j]):]]
        first_of = {}
        for r, j in zip(rows, lead):
            if r.cached_tokens is None:
                # A copy of another row's prompt computed none of its own KV.
                r.cached_tokens = cached[j] if j not in first_of else len(r.req.input_ids)
                self.stats["prompt_tokens"] += len(r.req.input_ids)
                self.stats["cached_tokens"] += r.cached_tokens
            first_of.setdefault(j, r)
            r.kv_version = version
        lens = torch.tensor([len(uniq[j]) for j in lead])
        self._evict_finished(compact=True)  # merging copies the batch anyway: drop finished rows now
        self._merge(rows, cache, mask, lens, tokens)
        self._record(rows, tokens, logprobs, version)
        self.stats["max_running_reqs"] = max(self.stats["max_running_reqs"], len(self._rows) - self._dead)

    def _prefill_shared_prefixes(self, uniq: list[tuple[int, ...]], full: set[int] = frozenset()) -> dict[int, int]:
        """Prefill, once, the whole blocks that several admitted prompts start with and the cache lacks
        (a system prompt shared by different questions, the first turns of parallel episodes), so
        the main prefill finds them cached. Returns {prompt index: its cache hit before} for the one
        prompt charged with computing each shared prefix. Prompts in `full` read no cache, so they are
        left out. Caller holds model_lock."""
        B = self.prefix_cache.block_size
        if len(uniq) < 2 or self.prefix_cache.max_tokens == 0:
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
            before = self.prefix_cache.match(ids, limit=n).tokens
            # Worth its own forward only when it saves at least a block's worth of recomputation.
            if n - before >= B and ids[:n] not in todo:
                todo[ids[:n]] = i
        if not todo:
            return {}
        charged = {i: self.prefix_cache.match(uniq[i], limit=len(uniq[i]) - 1).tokens for i in todo.values()}
        self._prefill_forward(list(todo))
        return charged

    def _prefill_forward(self, prompts: list[tuple[int, ...]], full: set[int] = frozenset()):
        """One forward over `prompts`, each starting from its cached prefix (prompts in `full`: from
        nothing, recording routed experts); inserts the new KV into the prefix cache. Returns (cache,
        mask (R, M + S), last-position logits (R, V), cached lengths, routed ids (R, S, layers, top_k)
        or None). Caller holds model_lock."""
        # At least one token is always computed: its logits choose the first output token.
        hits = [self.prefix_cache.match(ids, limit=0 if i in full else len(ids) - 1) for i, ids in enumerate(prompts)]
        cached = [h.tokens for h in hits]
        suffix = [len(ids) - c for ids, c in zip(prompts, cached)]
        R, M, S = len(prompts), max(cached), max(suffix)
        ids_t = torch.full((R, S), self.pad_token_id, dtype=torch.long)  # (R, S) suffixes, left-padded
        pos = torch.zeros((R, S), dtype=torch.long)
        mask = torch.zeros((R, M + S), dtype=torch.long)  # [pad | cached prefix | pad | suffix]
        for i, ids in enumerate(prompts):
            c, n = cached[i], suffix[i]
            ids_t[i, S - n:] = torch.tensor(ids[c:])
            pos[i, S - n:] = torch.arange(c, len(ids))
            mask[i, M - c:M] = 1
            mask[i, M + S - n:] = 1
        cache = _new_cache(self.model.config)
        if M:
            self._load_prefixes(cache, hits, cached, M)
        logits, routed = self._forward(ids_t, mask, pos, cache, logits_to_keep=1, capture=bool(full))
        self.stats["prefill_forwards"] += 1
        for i, ids in enumerate(prompts):
            self.prefix_cache.insert(ids, lambda a, b, i=i: _row_kv(cache, mask, i, a, b))
        return cache, mask, logits, cached, routed

    def _load_prefixes(self, cache, hits, cached: list[int], M: int) -> None:
        """Fill `cache` with each row's cached prefix, right-aligned at column M."""
        K = V = None
        for i, (h, c) in enumerate(zip(hits, cached)):
            if not c:
                continue
            k, v = PrefixCache.gather(h)  # (layers, H, c, D)
            if K is None:
                shape = (k.shape[0], len(hits), k.shape[1], M, k.shape[3])
                K, V = k.new_zeros(shape), v.new_zeros(shape)  # (layers, R, H, M, D)
            K[:, i, :, M - c:] = k
            V[:, i, :, M - c:] = v
        for layer_idx in range(K.shape[0]):
            cache.update(K[layer_idx], V[layer_idx], layer_idx)

    def _decode_step(self) -> None:
        mask = torch.cat([self._mask, torch.ones((len(self._rows), 1), dtype=torch.long)], dim=1)  # (B, L+1)
        with self.model_lock, torch.inference_mode():
            version = self.weight_version
            # Finished rows waiting for compaction keep stepping; clamping keeps their positions valid.
            pos = self._next_pos.clamp(max=self.context_length - 1)[:, None]
            capture = any(r.req.return_routed_experts and r.finish is None for r in self._rows)
            logits, routed = self._forward(self._last_tokens[:, None], mask, pos, self._cache, logits_to_keep=1,
                                           capture=capture)
            tokens, logprobs = self._sample(logits, self._rows)
        if routed is not None:
            for row, r in zip(self._rows, routed):  # r: (1, layers, top_k), the routing of the token just fed
                if row.req.return_routed_experts and row.finish is None:
                    row.routed.append(r)
        for row in self._rows:
            if row.kv_version != version and row.finish is None:
                row.kv_version = None  # its KV now spans two weight versions: never cache it
        self._mask = mask
        self._next_pos = self._next_pos + 1
        self._last_tokens = tokens
        self._record(self._rows, tokens, logprobs, version)
        self.stats["decode_forwards"] += 1

    def _sample(self, logits: torch.Tensor, rows: list[_Row]):
        return sample(logits, [r.req.params for r in rows], [r.generator for r in rows], self._generator)

    def _record(self, rows: list[_Row], tokens: torch.Tensor, logprobs: torch.Tensor, version: int) -> None:
        for row, t, lp in zip(rows, tokens.tolist(), logprobs.tolist()):
            if row.finish is not None:
                continue
            row.weight_version = version
            if not row.weight_versions or row.weight_versions[-1] != version:
                row.weight_versions.append(version)
            row.output_ids.append(t)
            row.logprobs.append(lp)
            self.stats["generated_tokens"] += 1
            row.finish = self._check_finish(row, t)

    def _check_finish(self, row: _Row, token: int) -> FinishReason | None:
        p = row.req.params
        n = len(row.output_ids)
        if token in self.eos_token_ids and not p.ignore_eos:
            return FinishReason("stop", matched=token)
        if token in p.stop_token_ids:
            return FinishReason("stop", matched=token)
        if p.stop:
            # Tokens can be partial characters, so decode a window wide enough for the longest stop string.
            window = max(len(s) for s in p.stop) + 8
            tail = self.tokenizer.decode(row.output_ids[-window:], skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in tail:
                    return FinishReason("stop", matched=s)
        if n >= p.max_new_tokens:
            return FinishReason("length", length=n)
        if len(row.req.input_ids) + n >= self.context_length:
            return FinishReason("length", length=n)
        return None

    def _merge(self, rows: list[_Row], cache, mask: torch.Tensor, lens: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append freshly prefilled rows to the running batch, left-padding whichever side is shorter."""
        if not self._rows:
            self._rows, self._cache, self._mask = rows, cache, mask
            self._next_pos, self._last_tokens = lens.clone(), tokens
            return
        L_old, L_new = self._mask.shape[1], mask.shape[1]
        L = max(L_old, L_new)
        for old, new in zip(self._cache.layers, cache.layers):
            # One assignment: setting keys alone would change the length the values view is cut to.
            old.keys, old.values = (
                torch.cat([_left_pad(old.keys, L - L_old), _left_pad(new.keys, L - L_new)], dim=0),
                torch.cat([_left_pad(old.values, L - L_old), _left_pad(new.values, L - L_new)], dim=0))
        self._mask = torch.cat([_left_pad(self._mask, L - L_old), _left_pad(mask, L - L_new)], dim=0)
        self._next_pos = torch.cat([self._next_pos, lens])
        self._last_tokens = torch.cat([self._last_tokens, tokens])
        self._rows = self._rows + rows

    def _cache_rows(self, indices: list[int]) -> None:
        """Offer the prompt + completion KV of running rows to the prefix cache."""
        if self.prefix_cache.max_tokens == 0:
            return
        with self.model_lock, torch.inference_mode():
            for i in indices:
                row = self._rows[i]
                if row.kv_version != self.weight_version:
                    continue
                # The last sampled token was never fed to the model, so it has no KV yet.
                ids = row.prefill_ids()[:-1]
                self.prefix_cache.insert(ids, lambda a, b, i=i: _row_kv(self._cache, self._mask, i, a, b))

    def _retract_all(self) -> None:
        """Move every running row back to the head of the queue; its KV survives in the prefix cache."""
        live = [i for i, r in enumerate(self._rows) if r.finish is None]
        self._cache_rows(live)
        rows = [self._rows[i] for i in live]
        self._reset_batch()
        if not rows:
            return
        self.stats["retracted_reqs"] += len(rows)
        with self._cond:
            self._inflight.difference_update(r.req.rid for r in rows)
            self._waiting.extendleft(reversed(rows))

    def _evict_finished(self, compact: bool = False) -> None:
        """Answer finished rows at once and free their slots; drop them from the batch tensors lazily.

        Removing a row copies the whole batch's KV, so finished rows stay in the tensors (their
        outputs ignored) until they are a quarter of the batch or new rows are merged in; a finished
        row's answer, its slot in max_batch_size and its prefix-cache entry never wait for that.
        """
        newly = [i for i, r in enumerate(self._rows) if r.finish is not None and not r.answered]
        if newly:
            self._cache_rows([i for i in newly if self._rows[i].output_ids])
            with self._cond:
                self._inflight.difference_update(self._rows[i].req.rid for i in newly)
            for i in newly:
                row = self._rows[i]
                row.answered = True
                if not row.future.done():
                    row.future.set_result(self._result(row, row.finish))
            self._dead += len(newly)
        if not self._dead or (not compact and self._dead * 4 < len(self._rows)):
            return
        keep = [i for i, r in enumerate(self._rows) if r.finish is None]
        self._dead = 0
        if not keep:
            self._reset_batch()
            return
        idx = torch.tensor(keep)
        mask = self._mask[idx]
        # Drop leading columns that are padding for every remaining row, so the cache does not grow
        # with the longest prompt that ever passed through.
        start = int(mask.any(dim=0).nonzero()[0])
        for layer in self._cache.layers:
            layer.keys, layer.values = layer.keys[idx, :, start:], layer.values[idx, :, start:]
        self._mask = mask[:, start:]
        self._next_pos = self._next_pos[idx]
        self._last_tokens = self._last_tokens[idx]
        self._rows = [self._rows[i] for i in keep]

    def _reset_batch(self) -> None:
        self._dead = 0
        self._rows, self._cache, self._mask, self._next_pos, self._last_tokens = [], None, None, None, None

    def _result(self, row: _Row, finish: FinishReason) -> GenerateResult:
        p = row.req.params
        text = self.tokenizer.decode(row.output_ids, skip_special_tokens=p.skip_special_tokens)
        if finish.type == "stop" and isinstance(finish.matched, str) and not p.no_stop_trim:
            text = text[: text.find(finish.matched)] if finish.matched in text else text
        return GenerateResult(
            rid=row.req.rid, text=text, prompt_tokens=len(row.req.input_ids), output_ids=list(row.output_ids),
            output_logprobs=list(row.logprobs) if row.req.return_logprob else None, finish_reason=finish,
            weight_version=row.weight_version if row.weight_version is not None else self.weight_version,
            cached_tokens=row.cached_tokens or 0, weight_versions=tuple(row.weight_versions),
            routed_experts=self._routed_experts(row) if row.req.return_routed_experts else None)

    @staticmethod
    def _routed_experts(row: _Row) -> str:
        # Empty when it finished before its prompt was computed (aborted in the queue, max_new_tokens=0).
        return encode_routed_experts(torch.cat(row.routed)) if row.routed else ""

    def _shutdown(self) -> None:
        with self._cond:
            pending = list(self._waiting)
            self._waiting.clear()
        for row in self._rows:
            if not row.future.done():
                row.future.set_result(self._result(row, FinishReason("abort", message="engine stopped")))
        for row in pending:
            row.future.set_result(self._result(row, FinishReason("abort", message="engine stopped")))
        self._reset_batch()


def _request_generator(params: SamplingParams) -> torch.Generator | None:
    if params.sampling_seed is None:
        return None
    return torch.Generator().manual_seed(params.sampling_seed)


def _new_cache(model_config):
    """An HF DynamicCache whose layers append in place into buffers with headroom."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model_config)
    cache.layers = [_growing_layer_class()() for _ in cache.layers]
    return cache


_GROWING_LAYER = None


def _growing_layer_class():
    """DynamicLayer appends by torch.cat, copying the whole batch's KV at every decode step; this one
    writes the new column into spare capacity and hands attention a view. Assigning `keys`/`values`
    (as merging and evicting rows do) replaces the buffer."""
    global _GROWING_LAYER
    if _GROWING_LAYER is not None:
        return _GROWING_LAYER
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, **kwargs):
            self._k = self._v = None
            self._len = 0
            super().__init__(**kwargs)

        @property
        def keys(self):
            return None if self._k is None else self._k[:, :, :self._len]

        @keys.setter
        def keys(self, t):
            self._k = t
            self._len = 0 if t is None else t.shape[-2]

        @property
        def values(self):
            return None if self._v is None else self._v[:, :, :self._len]

        @values.setter
        def values(self, t):
            self._v = t
            self._len = 0 if t is None else t.shape[-2]

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device = key_states.device
            B, H, _, D = key_states.shape
            self.keys = key_states.new_zeros((B, H, 0, D))
            self.values = value_states.new_zeros((B, H, 0, value_states.shape[-1]))
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            L, n = self._len, key_states.shape[-2]
            if L + n > self._k.shape[-2]:
                cap = L + n + max(64, L // 2)
                k, v = self._k, self._v
                self._k = k.new_empty(k.shape[:2] + (cap, k.shape[3]))
                self._v = v.new_empty(v.shape[:2] + (cap, v.shape[3]))
                self._k[:, :, :L] = k[:, :, :L]
                self._v[:, :, :L] = v[:, :, :L]
            self._k[:, :, L:L + n] = key_states
            self._v[:, :, L:L + n] = value_states
            self._len = L + n
            return self.keys, self.values

    _GROWING_LAYER = GrowingLayer
    return GrowingLayer


def _common_prefix_len(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _row_kv(cache, mask: torch.Tensor, i: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of batch row i's real tokens [a, b), each (layers, H, b - a, D)."""
    cols = mask[i].nonzero().squeeze(1)[a:b]
    return (torch.stack([layer.keys[i][:, cols] for layer in cache.layers]),
            torch.stack([layer.values[i][:, cols] for layer in cache.layers]))


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """Pad `n` zeros in front of the sequence dim: -2 for (B, H, L, D) caches, -1 for (B, L) masks."""
    if n == 0:
        return t
    dim = -2 if t.dim() == 4 else -1
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _check_cache_layout(model_config) -> None:
    """Merging and evicting rows edits (B, H, L, D) key/value tensors directly: plain layers only."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    for layer in DynamicCache(config=model_config).layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"the built-in engine batches with plain full-attention KV caches, but this model uses "
                f"{type(layer).__name__} (sliding-window or linear attention); serve it with SGLang instead")


def _cache_tokens(config: EngineConfig, model) -> int:
    """How many tokens of KV fit in config.prefix_cache_mb."""
    c = model.config
    c = getattr(c, "get_text_config", lambda: c)()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * itemsize
    return int(config.prefix_cache_mb * 2**20) // per_token


def _check_tags(tags) -> tuple[str, ...]:
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad or not tags:
        raise InvalidRequest(f"tags: {bad or tags!r} - send a non-empty subset of {list(MEMORY_TAGS)}")
    return tuple(tags)


def _return_freed_memory() -> None:
    """Hand freed heap pages back to the OS so the RSS really drops (glibc keeps them otherwise)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)

