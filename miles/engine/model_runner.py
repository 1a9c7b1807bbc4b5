"""The model runner: the torch work on the running batch, and the model it runs.

It holds the model, its lock and weight version, the prefix cache and the running batch (its rows
and their KV, kv_cache.py), and does what the scheduler asks, on the scheduler's thread:
  * prefill: compute admitted prompts (each from the longest cached prefix it starts with; identical
    prompts once; prefixes shared by several prompts once, ahead of them), sample each one's first
    token and merge the rows into the batch (prefill.py);
  * decode: one forward of shape (B, 1) over every row, then one sampled token per row;
  * retire, compact, retract: offer finished or retracted rows' KV to the prefix cache and drop them
    from the batch tensors.
Every forward, the sampling after it and every prefix-cache read or write hold `model_lock`; a
weight update (`load_weights`) holds it too, so weights only change between two steps.

Routed experts (MoE models, `return_routed_experts`): every forward that serves such a request
records each router's top-k ids (models/moe.py), and the row collects those of its own tokens: the
prefill's for its prompt, one per decode step after. Such a row computes its whole prompt rather than
reading cached KV, because the cache keeps KV but not the routing that produced it; its KV is still
offered to the cache for requests that do not ask.

LoRA adapters (lora.py) are applied by hooks on the adapted linears, per row: the prefix cache holds
KV computed with the default adapter only (the base model when there is none); a request on another
adapter reads and writes no cached KV, and identical prompts are computed once per adapter. Loading
or unloading an adapter that changes the default counts as a weight change (weights_epoch), and so
does a cache flush: no KV computed before it is cached after it.

With `quantization`, the Linear layers serve their weights in a low-precision format and dequantize
them in each matmul (precision/linear.py); the parameters themselves stay as received.

Fast decode (`fast_decode`, on for cuda by default): the batch's KV lives in a static cache
(static_kv.py) instead of kv_cache.BatchKV, behind the same interface, so prefill, retirement and the
prefix cache read and write it as before; decode() is then fast_decode.py's step (CUDA graphs,
sampling on the device, the host one step behind), and long prompts are prefilled a chunk per step
(chunked_prefill.py).

A vision-language model's requests carry image keys in their ids where image tokens go
(multimodal.py): a prefill holding any computes its input embeddings and 3-D rotary positions there
(and, for Qwen3-VL, the deepstack features its first decoder layers add there), and each row's next
position is offset by what its images took.

Hybrid models (Qwen3-Next, Qwen3.5, Nemotron-H) keep a recurrent state per row beside the attention layers'
KV (recurrent_state.py); the prefix cache is off for them. Nemotron-H's Mamba-2 decode steps are the
engine's own (mamba_step.py): transformers' recurrent step with the chunked form's time-step clamp;
so are Qwen3-Next's and Qwen3.5's gated delta-net forwards (delta_step.py): each position computed as
the trainer's chunked full forward computes it.

Non-goals: deciding what runs when (scheduler.py), sampling maths (sampler.py), the KV layout
(kv_cache.py), releasing memory (memory.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time

import torch

from miles.devices import exact_float32, resolve
from miles.engine_api.types import FinishReason, GenerateResult
from miles.models.loading import eos_token_ids, load_model, load_tokenizer
from miles.models.moe import hook_routers, moe_shape, routers
from miles.precision.linear import install, quantize_linears, served_weights
from miles.engine import delta_step, kv_cache, mamba_step, recurrent_state
from miles.engine.chunked_prefill import ChunkedPrefill
from miles.engine.config import EngineConfig
from miles.engine.decode_forward import FAMILIES
from miles.engine.fast_decode import FastDecoder
from miles.engine.graphs import DecodeGraphs
from miles.engine.kv_cache import BatchKV
from miles.engine.lora import Adapter, AdapterSet
from miles.engine.multimodal import ImageTable
from miles.engine.prefill import Prefill
from miles.engine.prefix_cache import PrefixCache
from miles.engine.row import Row
from miles.engine.sampler import SamplingBatch, sample
from miles.engine.static_kv import StaticKV
from miles.engine.window_masks import layer_masks, windowed

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(resolve(config.device, "rollout.engine.device"))
        if self.device.type == "cuda":  # indexed, so it compares equal to the devices of its tensors
            self.device = torch.device("cuda", torch.cuda.current_device())
            exact_float32()  # float32 serves as on cpu (rollout.engine.dtype bfloat16 is the faster path)
        self.model = load_model(config.model_path, dtype=config.dtype, device=str(self.device)).eval()
        # Mamba-2 decode steps clamp the time step as the chunked form (the trainer's forward) does.
        mamba_step.install(self.model)
        # Gated delta-net layers compute each position as the chunked form (the trainer's forward) does.
        delta_step.install(self.model)
        # Images of a vision-language model's requests (multimodal.py); None for a text model.
        self.images = ImageTable.serving(config, self.model)
        # Linear weights are then served as the format stores them, re-quantized whenever they change.
        quantize_linears(self.model, config.quantization, "serve", key="engine quantization",
                         embeddings=config.quantize_embeddings)
        self.quantized = served_weights(self.model)  # name -> (format, per_matrix): what may arrive quantized
        self.tokenizer = load_tokenizer(config.model_path)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.context_length = config.context_length or self.model.config.get_text_config().max_position_embeddings
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # Names and shapes are fixed for the engine's life; weight updates are validated against them.
        self.param_meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            n: (tuple(t.shape), t.dtype) for n, t in self.model.state_dict().items()}
        self._cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"
        kv_cache.check_layout(self.model.config)
        self.windowed = windowed(self.model.config)  # sliding-window layers: the engine builds the masks
        self._prepared_masks = _takes_prepared_mask(self.model)  # see _decode_mask
        # A recurrent layer's state after a prefix is not kept (recurrent_state.py): its rows compute
        # their whole prompt, and the prefix cache is off rather than holding KV nobody can use.
        prefix_mb = config.prefix_cache_mb if config.prefix_cache else 0
        if prefix_mb and recurrent_state.has_recurrent_state(self.model.config):
            log.warning("prefix cache off: this %r model keeps a recurrent state per sequence, which the engine "
                        "does not snapshot at block boundaries, so every request computes its whole prompt",
                        self.model.config.get_text_config().model_type)
            prefix_mb = 0
        # Running-batch KV the engine may hold (tokens), after weights and prefix cache take their share.
        self.kv_budget = kv_cache.budget_tokens(self.model, self.device, config.memory_fraction, prefix_mb,
                                                self.context_length)
        # Each row's recurrent state, counted as the tokens of KV it weighs as much as: the scheduler adds it
        # to every row's reservation, so admission does not overshoot the budget by rows x state size.
        self.state_tokens = 0
        if recurrent_state.has_recurrent_state(self.model.config):
            self.state_tokens = -(-recurrent_state.bytes_per_row(self.model) // kv_cache.bytes_per_token(self.model))
        self.moe_shape = moe_shape(self.model.config)  # (MoE layers, top_k); None for a dense model
        self.adapters = AdapterSet(self.model, config.max_lora_adapters, default_latest=not config.sglang_only)
        self.prefix_cache = PrefixCache(config.prefix_block_size,
                                        kv_cache.tokens_in(prefix_mb, self.model) if prefix_mb else 0)
        # The version label in force (a string on the wire; SGLang's servers start at "default"), and a
        # counter bumped by every weight load: labels may repeat, KV reuse must still see each change.
        self.weight_version = "default"
        self.weights_epoch = 0
        self.model_lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(config.seed)  # for rows without their own seed
        # Monotonic counters, written by the scheduler thread only (perf/ metrics, batching checks).
        self.stats = {"prefill_forwards": 0, "decode_forwards": 0, "generated_tokens": 0, "max_running_reqs": 0,
                      "prompt_tokens": 0, "cached_tokens": 0, "retracted_reqs": 0, "busy_s": 0.0,
                      "failed_steps": 0, "isolated_reqs": 0, "failed_reqs": 0,
                      # Where a step's time goes: prefill; decode's forward and sampling until the tokens
                      # reach the host; decode's bookkeeping on the host (stops, spans); prefix-cache inserts.
                      "prefill_s": 0.0, "decode_device_s": 0.0, "decode_host_s": 0.0, "cache_insert_s": 0.0}
        # The running batch: row i of `rows` is row i of every tensor in `kv`. Scheduler thread only.
        self.rows: list[Row] = []
        self.dead = 0  # finished rows still in the batch tensors (see compact)
        self.kv: BatchKV | StaticKV = BatchKV()
        self._sampling: tuple[list[Row], SamplingBatch] | None = None  # decode's, for the rows list it was built for
        self.prefiller = Prefill(self)
        # Fast decode (fast_decode.py): set when it serves this engine, with its graphs (`fast`) and, for
        # long prompts, the chunked prefill.
        self.decoder: FastDecoder | None = FastDecoder.setup(self)
        self.fast: DecodeGraphs | None = self.decoder.graphs if self.decoder is not None else None
        self.chunked: ChunkedPrefill | None = None
        if self.decoder is not None and config.prefill_chunk_tokens:
            self.chunked = ChunkedPrefill(self, config.prefill_chunk_tokens)

    def flush(self) -> None:
        """Record the fast decode's step still pending on the host, if any (fast_decode.py)."""
        if self.decoder is not None:
            self.decoder.flush()

    def release_static(self, kv: bool) -> None:
        """Drop the CUDA graphs (their memory pool) and, with `kv`, the static KV buffers; the next step
        allocates and captures again. Caller holds model_lock, with the running batch retracted."""
        if self.fast is not None:
            self.fast.clear()
            if kv:
                self.kv.free()

    @property
    def num_running(self) -> int:
        """Admitted and unfinished: in the batch, or waiting for their prompt's next chunk."""
        return len(self.rows) - self.dead + len(self.chunking)

    @property
    def chunking(self) -> list[Row]:
        """Admitted rows whose prompt is being prefilled a chunk per step (chunked_prefill.py)."""
        return self.chunked.rows if self.chunked is not None else []

    # ---- steps ------------------------------------------------------------------------------

    def prefill(self, rows: list[Row]) -> None:
        """Compute `rows`' prompts, sample their first tokens and append them to the running batch."""
        if self.chunked is not None:
            rows = self.chunked.take(rows)  # long prompts: a chunk per step from prefill_chunk()
            if not rows:
                return
        t0 = time.perf_counter()
        self.prefiller.run(rows)
        self.stats["prefill_s"] += time.perf_counter() - t0

    def prefill_chunk(self) -> None:
        """The next chunk of the first long prompt waiting; after its last it joins the batch."""
        self.chunked.step()

    def decode(self) -> None:
        """One token for every row of the running batch."""
        if self.decoder is not None:
            self.decoder.step()
            return
        kv = self.kv
        t0 = time.perf_counter()
        mask = torch.cat([kv.mask, kv.mask.new_ones((len(self.rows), 1))], dim=1)  # (B, L+1)
        with self.model_lock, torch.inference_mode():
            epoch, version = self.weights_epoch, self.weight_version
            # Finished rows waiting for compaction keep stepping; clamping keeps their positions valid.
            pos = kv.next_pos.clamp(max=self.context_length - 1)[:, None]  # (B, 1)
            capture = any(r.req.return_routed_experts and r.finish is None for r in self.rows)
            logits, routed = self.forward(kv.last_tokens[:, None], self._decode_mask(mask), pos, kv.cache,
                                           logits_to_keep=1, capture=capture,
                                           adapters=[self.adapter_of(r) for r in self.rows])
            # The batch's sampling tensors outlive a step: built again only when the rows list is replaced.
            if self._sampling is None or self._sampling[0] is not self.rows:
                self._sampling = (self.rows, SamplingBatch([r.req.params for r in self.rows], self.device))
            sampling = self._sampling[1]
            tokens, logprobs = sampling.sample(logits, sampling.uniforms([r.draws for r in self.rows], self._generator))
            host = tokens.tolist(), logprobs.tolist()  # waits for the device: the step's device time ends here
        kv.mask = mask
        kv.next_pos = kv.next_pos + 1
        kv.last_tokens = tokens
        t1 = time.perf_counter()
        self.stats["decode_device_s"] += t1 - t0
        self._recorded(t1, self.rows, routed, epoch, version, *host)

    def _decode_mask(self, mask: torch.Tensor):
        """The mask a decode step hands the model for its padding mask (B, L+1). transformers would make it
        None (nothing padded) or its boolean (B, 1, 1, L+1) form, at about the cost of a layer, and takes a
        prepared 4-D mask as it is; models that mask otherwise get the 2-D one."""
        if not self._prepared_masks or bool(mask.all()):
            return mask
        return mask.bool()[:, None, None, :]

    def _recorded(self, t1: float, rows: list[Row], routed, epoch: int, version: str, tokens: list[int],
                  logprobs: list[float]) -> None:
        """A decode step's host bookkeeping, once its tokens are on the host."""
        if routed is not None:
            for row, r in zip(rows, routed):  # r: (1, layers, top_k), the routing of the token just fed
                if row.req.return_routed_experts and row.finish is None:
                    row.routed.append(r)
        for row in rows:
            if row.kv_version != epoch and row.finish is None:
                row.kv_version = None  # its KV now spans two weight versions: never cache it
        self.record(rows, tokens, logprobs, version)
        self.stats["decode_forwards"] += 1
        self.stats["decode_host_s"] += time.perf_counter() - t1

    def abort(self, rids: set[str]) -> None:
        """Finish running rows `rids` as aborted (the scheduler then retires them)."""
        for row in self.rows:
            if row.req.rid in rids and row.finish is None:
                row.finish = FinishReason("abort", message="aborted")
        if self.chunked is not None:
            self.chunked.abort(rids)

    def retire_finished(self) -> list[Row]:
        """Rows that finished since the last call, marked answered (the caller answers them, then hands
        them to `cache_retired`). They stay in the batch tensors until `compact` drops them."""
        gone = self.chunked.finished() if self.chunked is not None else []  # aborted before their last chunk
        newly = [i for i, r in enumerate(self.rows) if r.finish is not None and not r.answered]
        if not newly:
            return gone
        for i in newly:
            self.rows[i].answered = True
        self.dead += len(newly)
        return [self.rows[i] for i in newly] + gone

    def cache_retired(self, rows: list[Row]) -> None:
        """Offer the KV of rows `retire_finished` returned to the prefix cache, whole blocks only; call it
        before `compact`, which drops them from the batch. A finished completion is reused only when a
        later prompt continues it (the next turn of a conversation), which recomputes at most a block's
        worth of its tail; copying every retired row's partial last block out of the batch was most of
        the cost of caching short completions, for KV no single-turn rollout reads again."""
        ids = {id(r) for r in rows}
        self._cache_rows([i for i, r in enumerate(self.rows) if id(r) in ids and r.output_ids], whole_blocks=True)

    def compact(self, force: bool = False) -> None:
        """Drop retired rows from the batch tensors.

        Removing a row copies the whole batch's KV, so retired rows stay (their outputs ignored) until
        they are a quarter of the batch, or until `force` (new rows are about to be merged, which
        copies the batch anyway); a finished row's answer, its slot in max_batch_size and its
        prefix-cache entry never wait for that.
        """
        if not self.dead or (not force and self.dead * 4 < len(self.rows)):
            return
        keep = [i for i, r in enumerate(self.rows) if r.finish is None]
        self.dead = 0
        if not keep:
            self._reset_batch()
            return
        self.kv.select(keep)
        self.rows = [self.rows[i] for i in keep]

    def retract(self, count: bool = True) -> list[Row]:
        """Take every running row out of the batch (to be queued again); its KV survives in the prefix
        cache, so coming back re-prefills little. `count`: a retraction (pause, memory release) rather
        than the end of a row's run alone (failure isolation)."""
        self.flush()
        live = [i for i, r in enumerate(self.rows) if r.finish is None]
        self._cache_rows(live)
        rows = [self.rows[i] for i in live] + [r for r in self.chunking if r.finish is None]
        self.reset()
        if count:
            self.stats["retracted_reqs"] += len(rows)
        return rows

    def reset(self) -> None:
        """Forget the running batch and the prompts waiting for a chunk (their rows must be answered or
        requeued by the caller)."""
        self._reset_batch()
        if self.chunked is not None:
            self.chunked.clear()

    def _reset_batch(self) -> None:
        if self.decoder is not None:
            self.decoder.pending = None  # a step still pending concerns rows the caller answered or requeued
        self.dead = 0
        self.rows = []
        self._sampling = None
        self.kv.reset()

    def result(self, row: Row, finish: FinishReason) -> GenerateResult:
        p = row.req.params
        text = self.tokenizer.decode(row.output_ids, skip_special_tokens=p.skip_special_tokens)
        if finish.type == "stop" and isinstance(finish.matched, str) and not p.no_stop_trim:
            text = text[: text.find(finish.matched)] if finish.matched in text else text
        return GenerateResult(
            rid=row.req.rid, text=text, prompt_tokens=len(row.req.input_ids), output_ids=list(row.output_ids),
            output_logprobs=list(row.logprobs) if row.req.return_logprob else None, finish_reason=finish,
            weight_version=row.weight_version if row.weight_version is not None else self.weight_version,
            cached_tokens=row.cached_tokens or 0, weight_versions=tuple(tuple(s) for s in row.weight_versions),
            routed_experts=row.routed_experts_wire() if row.req.return_routed_experts else None,
            input_logprobs=_real_pairs(self, row.input_logprob_pairs()) if row.req.return_logprob else None)

    def model_ids(self, ids):
        """Token ids as the model knows them (image keys as the image token, multimodal.py)."""
        return ids if self.images is None else self.images.real_ids(ids)

    # ---- weights ----------------------------------------------------------------------------

    def load_weights(self, tensors: dict[str, torch.Tensor], weight_version: str | None,
                     adopt: frozenset[str] | set[str],
                     quantized: dict | None = None) -> tuple[str, list[torch.Tensor]]:
        """Install `tensors` (see Engine.apply_weights); caller holds model_lock."""
        with torch.no_grad():
            state = self.model.state_dict()  # shares storage with the parameters; tied weights share too
            params = dict(self.model.named_parameters(remove_duplicate=False))  # tied names: one Parameter
            displaced = []
            for name, t in tensors.items():
                p = params.get(name)
                if (name in adopt and p is not None and t.dtype == p.dtype and t.shape == p.shape
                        and t.device == p.device and t.is_contiguous() and p.data.is_contiguous()):
                    displaced.append(p.data)
                    p.data = t
                else:
                    state[name].copy_(t)
            # Weights that arrived quantized keep the bytes they arrived as (no second quantization).
            install(self.model, quantized or {})
            if weight_version is not None:  # SGLang's rule: an update without a version keeps the label
                self.weight_version = weight_version
            self.weights_epoch += 1
            # KV computed by old weights is never reused by a request that starts under new ones.
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

    @functools.cached_property
    def routers(self) -> list[torch.nn.Module]:
        """The MoE routers whose choices are recorded, found when a request first asks for routed
        experts (models/moe.py raises UnknownRouter for a router it cannot record exactly); serving
        without routed experts never inspects them."""
        return routers(self.model)

    # ---- inside a step ----------------------------------------------------------------------

    def adapter_of(self, row: Row) -> Adapter | None:
        """The adapter row `row` decodes with: the one it named, else the default (caller holds model_lock)."""
        return row.req.adapter if row.req.adapter is not None else self.adapters.default

    def is_private(self, row: Row) -> bool:
        # The prefix cache holds the default adapter's KV only.
        return row.req.adapter is not None and row.req.adapter is not self.adapters.default

    def adapters_changed(self, default_before: Adapter | None) -> None:
        """After a load or unload (caller holds model_lock): a new default is a weight change."""
        if self.adapters.default is not default_before:
            self.weights_epoch += 1
            self.prefix_cache.clear()

    def forward(self, input_ids, mask, position_ids, cache, logits_to_keep: int, capture: bool = False,
                 adapters: list[Adapter | None] | None = None, last_only: bool = True, embeds=None):
        """Last-position logits (B, V) (not `last_only`: the last `logits_to_keep` positions' (B, K, V)),
        and with `capture` the routed expert ids (B, S, MoE layers, top_k).
        `adapters`: each row's LoRA adapter (None for all: the default adapter on every row).
        `embeds`: input embeddings (B, S, hidden) to use instead of `input_ids`' (images spliced in)."""
        kwargs = {self._cache_kwarg: cache}
        if embeds is not None:
            kwargs["inputs_embeds"], input_ids = embeds, None
        ids: list[torch.Tensor] = []
        if adapters is None:
            adapters = [self.adapters.default] * input_ids.shape[0]
        if self.windowed:
            queries = (embeds if embeds is not None else input_ids).shape[1]
            mask = layer_masks(self.model.config, mask, queries, next(self.model.parameters()).dtype)
        with hook_routers(self.routers if capture else [], lambda _layer, out: ids.append(out[2])), \
                self.adapters.applied(adapters):
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                             logits_to_keep=logits_to_keep, **kwargs)
        routed = None
        if capture:
            B, S = input_ids.shape
            routed = torch.stack(ids, dim=1).to(torch.int32).view(B, S, len(ids), -1)  # each was (B*S, top_k)
        return (out.logits[:, -1, :] if last_only else out.logits), routed

    def sample_rows(self, logits: torch.Tensor, rows: list[Row]):
        return sample(logits, [r.req.params for r in rows], [r.draws for r in rows], self._generator)

    def record(self, rows: list[Row], tokens: list[int], logprobs: list[float], version: str) -> None:
        for row, t, lp in zip(rows, tokens, logprobs):
            if row.finish is not None:
                continue
            row.weight_version = version
            spans = row.weight_versions
            if spans and spans[-1][0] == version:
                spans[-1][2] += 1
            else:
                spans.append([version, len(row.output_ids), len(row.output_ids) + 1])
            row.output_ids.append(t)
            row.logprobs.append(lp)
            self.stats["generated_tokens"] += 1
            row.finish = self._check_finish(row, t)

    def _check_finish(self, row: Row, token: int) -> FinishReason | None:
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

    def _cache_rows(self, indices: list[int], whole_blocks: bool = False) -> None:
        """Offer the prompt + completion KV of running rows to the prefix cache (`whole_blocks`: not their
        partial last block)."""
        if self.prefix_cache.max_tokens == 0:
            return
        t0 = time.perf_counter()
        with self.model_lock, torch.inference_mode():
            for i in indices:
                row = self.rows[i]
                if row.kv_version != self.weights_epoch:
                    continue
                # The last sampled token was never fed to the model, so it has no KV yet.
                ids = row.prefill_ids()[:-1]
                self.prefix_cache.insert(ids, lambda a, b, i=i: self.kv.row_kv(i, a, b), whole_blocks)
        self.stats["cache_insert_s"] += time.perf_counter() - t0


def _takes_prepared_mask(model) -> bool:
    """Whether every layer of `model` is masked by transformers' create_causal_mask for SDPA alone (the
    decode_forward families without sliding windows): its decode mask is then the padding mask's boolean form."""
    c = model.config.get_text_config()
    return (c.model_type in FAMILIES and model.config._attn_implementation == "sdpa"
            and "sliding_attention" not in (getattr(c, "layer_types", None) or ())
            and (getattr(c, "sliding_window", None) is None or c.model_type in ("qwen2", "qwen3")))


def _real_pairs(runner: ModelRunner, pairs):
    return pairs if runner.images is None else (runner.model_ids(pairs[0]), pairs[1])
