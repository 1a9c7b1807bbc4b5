"""The built-in engine: a Hugging Face causal LM behind a continuous-batching scheduler with a prefix cache.

`Engine` is what the HTTP server (server.py) and the weight receiver (weight_receiver.py) call. It
checks requests against the model and composes the parts, each in its own module:
  * scheduler.py: the request queue, admission, aborts, pause modes and the one background thread
    that runs every step;
  * model_runner.py: the model and the torch work on the running batch: prefill (from the longest
    cached prefix, identical prompts once), decode one token for every row, retire finished rows;
  * kv_cache.py: the running batch's dense KV, its growth, merging and compaction;
  * prefix_cache.py: KV of earlier prompts and completions, reused by prompts that start with them
    (the n samples of a GRPO group, the next turn of a multi-turn episode);
  * sampler.py: next-token sampling and the logprob convention;
  * memory.py: releasing and resuming the weights and the KV;
  * lora.py: LoRA adapters, loaded from PEFT directories and applied per request in the forward.

Logprob convention (details in sampler.py): each sampled token's logprob is taken from
log_softmax(logits / T) in float32 for T > 0, or log_softmax(logits) for greedy (T == 0), BEFORE any
top-k / top-p / min-p truncation, which is what the trainer recomputes teacher-forced.

Weight updates: every forward, the sampling after it and every prefix-cache read or write hold
`model_lock`; `apply_weights` takes the same lock, so weights only ever change between two steps and
no step sees a half-applied set. Each output records the weight version that produced its last token
(read under the lock, so it cannot disagree with the weights). Requests in flight across an update
continue on the new weights with the KV they already have; the prefix cache is emptied, so KV
computed by old weights is never reused by a request that starts under new ones.

Non-goals: paged attention, tensor parallelism, speculative decoding.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import CancelledError, Future, InvalidStateError

import torch

from miles.devices import cpu_threads
from miles.engine_api.errors import InvalidRequest
from miles.engine_api.sampling import SamplingParams
from miles.engine_api.types import MEMORY_TAGS, GenerateRequest, GenerateResult
from miles.models.routers import UnknownRouter
from miles.engine.config import EngineConfig
from miles.engine.lora import read_adapter
from miles.engine.memory import Memory
from miles.engine.model_runner import ModelRunner
from miles.engine.scheduler import Scheduler
from miles.engine.weight_receiver import WeightReceiver


class Engine:
    def __init__(self, config: EngineConfig):
        torch.set_num_threads(cpu_threads(config.num_threads))
        self.config = config
        self.runner = ModelRunner(config)
        # Fixed for the engine's life: what the server and the weight receiver read.
        self.model, self.tokenizer = self.runner.model, self.runner.tokenizer
        self.vocab_size, self.context_length = self.runner.vocab_size, self.runner.context_length
        self.pad_token_id = self.runner.pad_token_id
        self.param_meta = self.runner.param_meta
        self.quantized = self.runner.quantized  # weights served in a format: they may arrive as its bytes
        self.prefix_cache = self.runner.prefix_cache
        self.model_lock = self.runner.model_lock
        self.stats = self.runner.stats
        self.receiver = WeightReceiver(self, timeout_s=config.weight_update_timeout_s)
        self.scheduler = Scheduler(config, self.runner)
        self.memory = Memory(self.runner, self.scheduler, self.receiver, config.offload_dir)

    @property
    def weight_version(self) -> str:
        return self.runner.weight_version

    def set_weight_version(self, label: str) -> None:
        """Relabel the weights in force (SGLang's /update_weight_version); the weights stay as they are."""
        with self.model_lock:
            self.runner.weight_version = label

    # ---- generation -------------------------------------------------------------------------

    def make_request(self, input_ids, params: SamplingParams | None = None, return_logprob: bool = False,
                     rid: str | None = None, return_routed_experts: bool = False,
                     lora_path: str | None = None, logprob_start_len: int = -1,
                     image_data: list[str] | None = None) -> GenerateRequest:
        """Build a request and check it against this model; raises InvalidRequest naming the field.
        `image_data`: SGLang's, one base64 image per image placeholder in `input_ids` (multimodal.py)."""
        params = params or SamplingParams(max_new_tokens=self.config.default_max_new_tokens)
        ids = tuple(input_ids)
        if not ids:
            raise InvalidRequest("input_ids: the prompt is empty; send at least one token")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"input_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        images = ()
        if image_data:
            if self.runner.images is None:
                raise InvalidRequest("image_data: this model has no vision tower; send text only, or serve a "
                                     "vision-language model")
            # Decoding and the image processor run here, on the request's thread, not the scheduler's.
            ids, images = self.runner.images.admit(list(ids), list(image_data))
        if len(ids) >= self.context_length:
            raise InvalidRequest(f"input_ids: the prompt has {len(ids)} tokens but the context length is "
                                 f"{self.context_length}; shorten the prompt")
        if params.max_new_tokens > self.context_length:
            raise InvalidRequest(f"sampling_params.max_new_tokens: {params.max_new_tokens} exceeds the context "
                                 f"length {self.context_length}")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"sampling_params.stop_token_ids: {bad} is outside the vocabulary")
        if return_routed_experts:
            self._check_routed_experts()
        if not -1 <= logprob_start_len <= len(ids):
            raise InvalidRequest(f"logprob_start_len: {logprob_start_len} is outside [-1, {len(ids)}] for a prompt of "
                                 f"{len(ids)} tokens; send -1 (output tokens only) or a position in the prompt")
        adapter = None
        if lora_path is not None:  # SGLang's field holds the adapter's name; the request keeps that adapter
            with self.model_lock:
                adapter = self.runner.adapters.get(lora_path)
        return GenerateRequest(rid=rid or uuid.uuid4().hex, input_ids=ids, params=params,
                               return_logprob=return_logprob, return_routed_experts=return_routed_experts,
                               logprob_start_len=logprob_start_len if return_logprob else -1, adapter=adapter,
                               images=images)

    def _check_routed_experts(self) -> None:
        """A request for routed experts needs an MoE model whose routers miles records exactly."""
        if self.runner.moe_shape is None:
            raise InvalidRequest("return_routed_experts: this model has no mixture-of-experts layers, so there are "
                                 "no routed experts to return; send false")
        try:
            self.runner.routers
        except UnknownRouter as e:
            raise InvalidRequest(f"return_routed_experts: {e}") from None

    def submit(self, req: GenerateRequest, listener=None) -> Future:
        """Queue a request; the future resolves to a GenerateResult. `listener(ids, logprobs)` gets the
        new tokens after every step (Scheduler.submit; streaming.py wraps it for an event loop)."""
        return self.scheduler.submit(req, listener)

    def submit_all(self, reqs: list[GenerateRequest]) -> Future:
        """Queue requests together (one prefill can take them all); the future resolves to their
        GenerateResults in order once every one has, or to the first failure. One future for a batched
        /generate, so its waiter wakes once rather than once per request."""
        return _all_of(self.scheduler.submit_many(reqs))

    def generate(self, input_ids, params: SamplingParams | None = None, return_logprob: bool = False,
                 rid: str | None = None, timeout: float | None = None) -> GenerateResult:
        return self.submit(self.make_request(input_ids, params, return_logprob, rid)).result(timeout)

    def abort(self, rid: str | None = None) -> None:
        """Abort one request by id, or every request when rid is None (see Scheduler.abort)."""
        self.scheduler.abort(rid)

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting)."""
        return self.scheduler.num_requests()

    # ---- control ----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self.scheduler.paused

    @property
    def unservable(self) -> str | None:
        """Why generation is held because the weights are not the served model's (None: they are)."""
        return self.scheduler.unservable

    @property
    def released(self) -> tuple[str, ...]:
        return self.scheduler.released

    def pause(self, mode: str = "abort", timeout: float = 120.0) -> None:
        """Stop generating; returns once no forward is running and `mode` has been carried out."""
        self.scheduler.pause(mode, timeout)

    def continue_generation(self) -> None:
        self.scheduler.continue_generation()

    def release_memory(self, tags: tuple[str, ...] = MEMORY_TAGS, timeout: float = 120.0) -> None:
        """Free the weights and/or the KV until resume_memory (see memory.py)."""
        self.memory.release(tags, timeout)

    def resume_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        self.memory.resume(tags)

    def flush_cache(self) -> None:
        """Drop every cached prefix; running requests keep their own KV. The flush starts a new KV epoch
        (weights_epoch), so KV computed before it, of rows still running or answered and not yet
        offered to the cache, never enters the cache after it."""
        with self.model_lock:
            self.prefix_cache.clear()
            self.runner.weights_epoch += 1

    # ---- LoRA adapters (lora.py) --------------------------------------------------------------

    def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> dict[str, str]:
        """Load the PEFT adapter at `path` as `name`; returns {name: path} of every loaded adapter.
        InvalidRequest (nothing changed) for a taken name, a full engine or an adapter that does not fit."""
        with self.model_lock:
            if self.runner.images is not None:
                raise InvalidRequest(f"load_lora_adapter {name!r}: LoRA adapters are not supported on a "
                                     "vision-language model in the built-in engine; train it without LoRA")
            self.runner.adapters.check_new(name)  # before reading the files: a refusal costs nothing
        adapter = read_adapter(name, path, self.model, pinned)  # file reads outside the lock: decoding goes on
        with self.model_lock:
            before = self.runner.adapters.default
            self.runner.adapters.add(adapter)
            self.runner.adapters_changed(before)
            return self.runner.adapters.loaded()

    def unload_lora_adapter(self, name: str) -> dict[str, str]:
        """Unload adapter `name` (requests that named it finish on it); returns the adapters still loaded."""
        with self.model_lock:
            before = self.runner.adapters.default
            self.runner.adapters.remove(name)
            self.runner.adapters_changed(before)
            return self.runner.adapters.loaded()

    def lora_adapters(self) -> dict[str, str]:
        with self.model_lock:
            return self.runner.adapters.loaded()

    def stop(self) -> None:
        self.scheduler.stop()
        self.receiver.close()
        self.memory.close()

    # ---- weights (called by the weight receiver) --------------------------------------------

    def apply_weights(self, tensors: dict[str, torch.Tensor], weight_version: str | None,
                      adopt: frozenset[str] | set[str] = frozenset(),
                      quantized: dict | None = None) -> tuple[str, list[torch.Tensor]]:
        """Install `tensors` between two decode steps; returns (new weight version, displaced memory).

        A tensor named in `adopt` is held by nobody but the caller, so its parameter takes over its
        memory instead of copying from it: an update then costs no second pass over the weights. The
        parameter's previous memory is returned so the caller can receive the next update into it.
        Everything else (and any dtype or layout mismatch) is copied in place. `quantized`: name ->
        the stored matrices a weight arrived as (precision/wire.py); its layer serves those bytes.
        """
        with self.model_lock:
            if self.memory.weights_released:
                raise InvalidRequest("the engine's weights are released; call /resume_memory_occupation "
                                     "before updating them")
            return self.runner.load_weights(tensors, weight_version, adopt, quantized)

    def covers_parameters(self, names) -> bool:
        """Whether `names` reach every parameter (tied ones through any of their names)."""
        return self.runner.covers_parameters(names)

    def points_into(self, buf: torch.Tensor) -> bool:
        """Whether any parameter or buffer of the model lives in `buf`'s memory."""
        return self.runner.points_into(buf)


def _all_of(futures: list[Future]) -> Future:
    """A future of every result of `futures`, in order, or of the first exception among them."""
    out: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def done(f: Future) -> None:
        with lock:
            if out.done():  # failed already, or cancelled by its waiter
                return
            try:
                if f.cancelled() or f.exception() is not None:
                    out.set_exception(CancelledError() if f.cancelled() else f.exception())
                    return
                left[0] -= 1
                if left[0] == 0:
                    out.set_result([g.result() for g in futures])
            except InvalidStateError:  # its waiter cancelled it meanwhile
                pass

    if not futures:
        out.set_result([])
    for f in futures:
        f.add_done_callback(done)
    return out
