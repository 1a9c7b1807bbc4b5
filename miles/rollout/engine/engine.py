"""The built-in engine: a Hugging Face causal LM behind a continuous-batching scheduler.

One background thread owns the running batch and its KV cache (an HF DynamicCache, rows left-padded
to a common length). Each iteration it
  1. admits waiting requests (up to max_batch_size): their prompts are prefilled together, left-padded,
     with position_ids = cumsum(mask) - 1, and their caches are merged into the running batch;
  2. runs one decode forward of shape (B, 1) for every running row;
  3. evicts rows that finished (EOS, stop token, stop string, max_new_tokens, context length, abort).
Every forward and the sampling after it run while holding `model_lock`; a weight update takes the
same lock, so weights only ever change between two steps and no step sees a half-applied set.

Logprob convention (details in sampler.py): each sampled token's logprob is taken from
log_softmax(logits / T) in float32 for T > 0, or log_softmax(logits) for greedy (T == 0), BEFORE any
top-k / top-p / min-p truncation, which is what the trainer recomputes teacher-forced.
Each output records the weight version that produced its last token (read under the lock, so it
cannot disagree with the weights).
Requests in flight across an update continue on the new weights with the KV cache they already have.
Non-goals: prefix caching, paged attention, tensor parallelism, speculative decoding.
"""

from __future__ import annotations

import inspect
import logging
import threading
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from miles.models.loading import load_model, load_tokenizer
from miles.rollout.engine.config import EngineConfig
from miles.rollout.engine.sampler import SamplingParams, sample
from miles.rollout.engine.types import FinishReason, GenerateRequest, GenerateResult, InvalidRequest
from miles.rollout.engine.weight_receiver import WeightReceiver

log = logging.getLogger(__name__)


@dataclass
class _Row:
    """A request while it is in the running batch."""

    req: GenerateRequest
    future: Future
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    weight_version: int | None = None  # version of the weights that produced the latest token


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
        self.weight_version = 0
        self.receiver = WeightReceiver(self, timeout_s=config.weight_update_timeout_s)
        self.model_lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting: deque[tuple[GenerateRequest, Future]] = deque()
        self._aborts: set[str] = set()  # rids to abort at the next step; only ever rids in flight
        self._inflight: set[str] = set()  # rids admitted to the running batch and not yet finished
        self._generator = torch.Generator().manual_seed(config.seed)
        self._stopping = False
        # Monotonic counters, written by the scheduler thread only (perf/ metrics, batching checks).
        self.stats = {"prefill_forwards": 0, "decode_forwards": 0, "generated_tokens": 0, "max_running_reqs": 0}
        # Running batch; only the scheduler thread touches these.
        self._rows: list[_Row] = []
        self._cache = None
        self._mask: torch.Tensor | None = None  # (B, L) 1 = real token
        self._next_pos: torch.Tensor | None = None  # (B,) position of the next input token
        self._last_tokens: torch.Tensor | None = None  # (B,) next input token
        self._thread = threading.Thread(target=self._loop, name="miles-engine-scheduler", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------

    def make_request(self, input_ids, params: SamplingParams | None = None, return_logprob: bool = False,
                     rid: str | None = None) -> GenerateRequest:
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
        return GenerateRequest(rid=rid or uuid.uuid4().hex, input_ids=ids, params=params,
                               return_logprob=return_logprob)

    def submit(self, req: GenerateRequest) -> Future:
        """Queue a request; the future resolves to a GenerateResult."""
        fut: Future = Future()
        if req.params.max_new_tokens == 0:
            fut.set_result(self._result(_Row(req, fut, None), FinishReason("length", length=0)))
            return fut
        with self._cond:
            if self._stopping:
                fut.set_result(self._result(_Row(req, fut, None), FinishReason("abort", message="engine stopped")))
                return fut
            self._waiting.append((req, fut))
            self._cond.notify()
        return fut

    def generate(self, input_ids, params: SamplingParams | None = None, return_logprob: bool = False,
                 rid: str | None = None, timeout: float | None = None) -> GenerateResult:
        return self.submit(self.make_request(input_ids, params, return_logprob, rid)).result(timeout)

    def abort(self, rid: str | None = None) -> None:
        """Abort one request by id, or every request when rid is None; they finish with type abort."""
        with self._cond:
            keep = deque()
            for req, fut in self._waiting:
                if rid is None or req.rid == rid:
                    fut.set_result(self._result(_Row(req, fut, None), FinishReason("abort", message="aborted")))
                else:
                    keep.append((req, fut))
            self._waiting = keep
            # Only rids in flight now: a stale entry would abort a later request that reuses the id.
            self._aborts |= set(self._inflight) if rid is None else {rid} & self._inflight
            self._cond.notify()

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cond:
            return len(self._rows), len(self._waiting)

    def flush_cache(self) -> None:
        """There is no cross-request (prefix) cache yet, so there is nothing to drop."""

    def apply_weights(self, tensors: dict[str, torch.Tensor], weight_version: int | None) -> int:
        """Copy `tensors` into the model between two decode steps; returns the new weight version."""
        with self.model_lock, torch.no_grad():
            state = self.model.state_dict()  # shares storage with the parameters; tied weights share too
            for name, t in tensors.items():
                state[name].copy_(t)
            self.weight_version = weight_version if weight_version is not None else self.weight_version + 1
            return self.weight_version

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # ---- scheduler --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._rows:
                    self._cond.wait()
                if self._stopping:
                    break
                room = self.config.max_batch_size - len(self._rows)
                admit = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                self._inflight.update(req.rid for req, _ in admit)
                aborts, self._aborts = self._aborts, set()
            try:
                if admit:
                    self._prefill(admit)
                    self._evict_finished()
                # After admission, so an abort that raced with it still finds its row.
                self._apply_aborts(aborts)
                if self._rows:
                    self._decode_step()
                    self._evict_finished()
            except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
                log.exception("engine step failed; failing the running batch")
                for row in self._rows:
                    if not row.future.done():
                        row.future.set_exception(exc)
                for _, fut in admit:
                    if not fut.done():
                        fut.set_exception(exc)
                self._reset_batch()
                with self._cond:
                    self._inflight.clear()
        self._shutdown()

    def _apply_aborts(self, aborts: set[str]) -> None:
        if not aborts:
            return
        for row in self._rows:
            if row.req.rid in aborts:
                row.finish = FinishReason("abort", message="aborted")
        self._evict_finished()

    def _forward(self, input_ids, mask, position_ids, cache, logits_to_keep: int):
        kwargs = {self._cache_kwarg: cache}
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                         logits_to_keep=logits_to_keep, **kwargs)
        return out.logits[:, -1, :]  # (B, V)

    def _prefill(self, admit: list[tuple[GenerateRequest, Future]]) -> None:
        from transformers import DynamicCache

        rows = [_Row(req, fut, _request_generator(req.params)) for req, fut in admit]
        lens = [len(r.req.input_ids) for r in rows]
        P = max(lens)
        ids = torch.full((len(rows), P), self.pad_token_id, dtype=torch.long)  # (n, P), left-padded
        mask = torch.zeros((len(rows), P), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, P - lens[i]:] = torch.tensor(r.req.input_ids)
            mask[i, P - lens[i]:] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        with self.model_lock, torch.inference_mode():
            version = self.weight_version
            logits = self._forward(ids, mask, pos, cache, logits_to_keep=1)
            tokens, logprobs = self._sample(logits, rows)
        self._merge(rows, cache, mask, torch.tensor(lens), tokens)
        self._record(rows, tokens, logprobs, version)
        self.stats["prefill_forwards"] += 1
        self.stats["max_running_reqs"] = max(self.stats["max_running_reqs"], len(self._rows))

    def _decode_step(self) -> None:
        mask = torch.cat([self._mask, torch.ones((len(self._rows), 1), dtype=torch.long)], dim=1)  # (B, L+1)
        with self.model_lock, torch.inference_mode():
            version = self.weight_version
            logits = self._forward(self._last_tokens[:, None], mask, self._next_pos[:, None], self._cache,
                                   logits_to_keep=1)
            tokens, logprobs = self._sample(logits, self._rows)
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
            old.keys = torch.cat([_left_pad(old.keys, L - L_old), _left_pad(new.keys, L - L_new)], dim=0)
            old.values = torch.cat([_left_pad(old.values, L - L_old), _left_pad(new.values, L - L_new)], dim=0)
        self._mask = torch.cat([_left_pad(self._mask, L - L_old), _left_pad(mask, L - L_new)], dim=0)
        self._next_pos = torch.cat([self._next_pos, lens])
        self._last_tokens = torch.cat([self._last_tokens, tokens])
        self._rows = self._rows + rows

    def _evict_finished(self) -> None:
        done = [i for i, r in enumerate(self._rows) if r.finish is not None]
        if not done:
            return
        with self._cond:
            self._inflight.difference_update(self._rows[i].req.rid for i in done)
        for i in done:
            row = self._rows[i]
            if not row.future.done():
                row.future.set_result(self._result(row, row.finish))
        keep = [i for i, r in enumerate(self._rows) if r.finish is None]
        if not keep:
            self._reset_batch()
            return
        idx = torch.tensor(keep)
        mask = self._mask[idx]
        # Drop leading columns that are padding for every remaining row, so the cache does not grow
        # with the longest prompt that ever passed through.
        start = int(mask.any(dim=0).nonzero()[0])
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]
        self._mask = mask[:, start:]
        self._next_pos = self._next_pos[idx]
        self._last_tokens = self._last_tokens[idx]
        self._rows = [self._rows[i] for i in keep]

    def _reset_batch(self) -> None:
        self._rows, self._cache, self._mask, self._next_pos, self._last_tokens = [], None, None, None, None

    def _result(self, row: _Row, finish: FinishReason) -> GenerateResult:
        p = row.req.params
        text = self.tokenizer.decode(row.output_ids, skip_special_tokens=p.skip_special_tokens)
        if finish.type == "stop" and isinstance(finish.matched, str) and not p.no_stop_trim:
            text = text[: text.find(finish.matched)] if finish.matched in text else text
        return GenerateResult(
            rid=row.req.rid, text=text, prompt_tokens=len(row.req.input_ids), output_ids=list(row.output_ids),
            output_logprobs=list(row.logprobs) if row.req.return_logprob else None, finish_reason=finish,
            weight_version=row.weight_version if row.weight_version is not None else self.weight_version)

    def _shutdown(self) -> None:
        with self._cond:
            pending = list(self._waiting)
            self._waiting.clear()
        for row in self._rows:
            if not row.future.done():
                row.future.set_result(self._result(row, FinishReason("abort", message="engine stopped")))
        for req, fut in pending:
            fut.set_result(self._result(_Row(req, fut, None), FinishReason("abort", message="engine stopped")))
        self._reset_batch()


def _request_generator(params: SamplingParams) -> torch.Generator | None:
    if params.sampling_seed is None:
        return None
    return torch.Generator().manual_seed(params.sampling_seed)


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


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)

