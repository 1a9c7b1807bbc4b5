"""The running batch's KV cache: one dense key/value pair per layer, every row aligned on the right.

Layout. Each layer holds keys and values of shape (B, H, L, D). Row b's real tokens are the columns
where `mask[b]` is 1; rows are right-aligned, so a decode step writes every row's new token into the
same new column L. Shorter rows are padded on the left with zero columns the mask hides.
  * growth: a decode step appends one column. Layers write it into spare capacity (GrowingLayer)
    rather than re-concatenating the whole batch's KV at every step.
  * merging: freshly prefilled rows join the batch, left-padding whichever side is shorter.
  * compaction: dropping rows selects the rest and cuts leading columns that are padding for every
    remaining row, so L does not keep the length of the longest prompt that ever passed through.
  * prefix cache (prefix_cache.py): `row_kv` reads one row's real KV out for an insert;
    `load_prefixes` writes cached prefixes into a fresh cache before a prefill computes the rest.
BatchKV keeps the per-row tensors of the running batch aligned with each other; which row is which
request is the model runner's business.

Budget: the engine holds at most `memory_fraction` of its device's memory; `budget_tokens` says how
many tokens of running-batch KV that leaves (rows are padded to the longest, so the scheduler counts
rows x the longest reservation).
MLA layers (DeepSeek-V3/Kimi, GLM-5) hold what transformers caches for them: the compressed latent,
one head of kv_lora_rank (keys' slot) and the shared rotary key (values' slot), expanded into per-head
keys and values at each attention; the budget counts that entry (`bytes_per_token`).
Sliding-window layers (GPT-OSS) keep every token's KV like full ones; the engine windows their
attention with masks of its own (window_masks.py). DSA layers of GLM-5 that run their own indexer keep
one indexer key per token beside the KV, in the same columns (GrowingIndexedLayer); merging,
compaction and the prefix cache carry it with the KV, so a decode step's indexer scores the same keys
a full forward would (models/dsa.py). Linear-attention and Mamba layers of the hybrid
families (Qwen3-Next, Qwen3.5, Nemotron-H) keep transformers' own state layer, merged and selected row for row
(recurrent_state.py); layers without attention (Nemotron-H's MoE and MLP blocks) hold nothing.
Non-goals: paged attention (block tables); DSA layers of other families (DeepSeek-V3.2) and recurrent
layers of other families (refused by `check_layout`, naming the layer kind); moving KV between devices.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import (DummyLayer, DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer,
                                      LinearAttentionLayer)

from miles.config.loader import ConfigError
from miles.devices import total_memory
from miles.engine import recurrent_state
from miles.engine.prefix_cache import Match, PrefixCache
from miles.engine.window_masks import unsupported_layer_types, windowed
from miles.models.dsa import INDEXERS, indexer_layers


class GrowingLayer(DynamicLayer):
    """DynamicLayer appends by torch.cat, copying the whole batch's KV at every decode step; this one
    writes the new columns into spare capacity and hands attention a view. Assigning `keys`/`values`
    (as merging and compacting do) replaces the buffer."""

    def __init__(self, **kwargs):
        self._k = self._v = None  # (B, H, capacity, D); columns [0, _len) are in use
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

    def reserve(self, capacity: int) -> None:
        """Room for `capacity` columns in all, so appends up to it copy nothing already held."""
        L = self._len
        if capacity <= self._k.shape[-2]:
            return
        k, v = self._k, self._v
        self._k = k.new_empty(k.shape[:2] + (capacity, k.shape[3]))
        self._v = v.new_empty(v.shape[:2] + (capacity, v.shape[3]))
        self._k[:, :, :L] = k[:, :, :L]
        self._v[:, :, :L] = v[:, :, :L]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        L, n = self._len, key_states.shape[-2]
        if L + n > self._k.shape[-2]:
            self.reserve(_capacity(L, n))
        self._k[:, :, L:L + n] = key_states
        self._v[:, :, L:L + n] = value_states
        self._len = L + n
        return self.keys, self.values

    def select(self, idx: torch.Tensor, start: int) -> None:
        """Keep rows `idx` and columns from `start`, gathered straight into buffers with the room the next
        decode step's append would reserve: compaction copies the batch's KV once, not twice."""
        L = self._len - start
        self._k, self._v = (_gather_rows(t[:, :, start:self._len], idx, _capacity(L, 1)) for t in (self._k, self._v))
        self._len = L

    def streams(self) -> tuple[torch.Tensor, ...]:
        """What the layer holds per token, each with tokens on dim -2: keys and values (B, H, L, D)."""
        return self.keys, self.values

    def assign(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace what `streams` returns (rows merged or selected); one call, so no stream is ever
        viewed at another's length."""
        self.keys, self.values = keys, values


class GrowingIndexedLayer(GrowingLayer):
    """A DSA layer running its own indexer (models/dsa.py): the KV (GLM-5: the MLA latent) plus one
    indexer key per token, (B, L, D_index), in the same columns, grown in place like the KV."""

    def __init__(self, **kwargs):
        self._ik = None  # (B, capacity, D_index); columns [0, _len) in use, as for the KV
        super().__init__(**kwargs)

    @property
    def indexer_keys(self):
        return None if self._ik is None else self._ik[:, :self._len]

    def update_indexer(self, key_states: torch.Tensor) -> torch.Tensor:
        """Called by the indexer after the layer's `update` has written the same tokens' KV: those
        columns are already counted in `_len`."""
        n = key_states.shape[1]
        if self._ik is None:
            self._ik = key_states.new_zeros((key_states.shape[0], self._k.shape[-2], key_states.shape[2]))
        elif self._ik.shape[1] < self._k.shape[-2]:  # the KV grew its capacity: follow it
            ik = self._ik
            self._ik = ik.new_empty((ik.shape[0], self._k.shape[-2], ik.shape[2]))
            self._ik[:, :self._len - n] = ik[:, :self._len - n]
        self._ik[:, self._len - n:self._len] = key_states
        return self.indexer_keys

    def select(self, idx: torch.Tensor, start: int) -> None:
        if self._ik is not None:  # no headroom: update_indexer follows the KV's capacity
            self._ik = self._ik[:, start:self._len].index_select(0, idx)
        super().select(idx, start)

    def streams(self) -> tuple[torch.Tensor, ...]:
        """Keys, values (B, H, L, D) and indexer keys (B, L, D_index)."""
        return self.keys, self.values, self.indexer_keys

    def assign(self, keys: torch.Tensor, values: torch.Tensor, indexer_keys: torch.Tensor | None = None) -> None:
        self.keys, self.values = keys, values
        self._ik = indexer_keys


def _capacity(L: int, n: int) -> int:
    """Columns to hold when L are held and n more arrive: half again as much headroom, so a long decode
    reallocates O(log L) times, not every step."""
    return L + n + max(64, L // 2)


def _gather_rows(t: torch.Tensor, idx: torch.Tensor, capacity: int) -> torch.Tensor:
    """Rows `idx` of `t` (B, H, L, D) in a new (len(idx), H, capacity, D) buffer, columns [0, L) filled."""
    out = t.new_empty((len(idx), t.shape[1], capacity, t.shape[3]))
    torch.index_select(t, 0, idx, out=out[:, :, :t.shape[2]])
    return out


def new_cache(model_config) -> DynamicCache:
    """An empty HF DynamicCache whose attention layers append in place into buffers with headroom, DSA
    layers that run an indexer with its keys beside the KV (recurrent-state and attention-free layers
    stay transformers' own)."""
    cache = DynamicCache(config=model_config)
    indexed = set(indexer_layers(model_config))
    cache.layers = [layer if _keeps_no_kv(layer) else GrowingIndexedLayer() if i in indexed else GrowingLayer()
                    for i, layer in enumerate(cache.layers)]
    return cache


def _keeps_no_kv(layer) -> bool:
    return recurrent_state.is_state_layer(layer) or isinstance(layer, DummyLayer)


def kv_layers(model_config) -> int:
    """How many layers keep per-token KV (hybrid models: the attention layers only)."""
    return sum(not _keeps_no_kv(layer) for layer in DynamicCache(config=model_config).layers)


# Cache layer classes of transformers the built-in engine cannot batch, and what they hold.
_UNSUPPORTED_LAYERS = {
    "DynamicSlidingWindowLayer": "sliding-window attention (a KV window that drops old tokens)",
    "LinearAttentionLayer": "linear attention or Mamba (a recurrent state per sequence, not KV per token) of a "
                            "family whose padding the engine has not checked (it batches "
                            f"{', '.join(recurrent_state.PADDING_EXACT)})",
    "DynamicIndexedLayer": "DSA indexed attention (an indexer key cache beside the KV) of a family whose indexer "
                           f"the engine does not run (it serves {', '.join(sorted(INDEXERS.values()))})",
}


def check_layout(model_config) -> None:
    """Merging and compacting rows edits (B, H, L, D) key/value tensors directly: plain layers, and
    the kinds the engine holds itself (sliding-window, checked recurrent families, GLM-5's DSA layers).
    Refuses any other kind of layer, naming it and the layers of that kind."""
    c = model_config.get_text_config()
    kinds = getattr(c, "layer_types", None) or getattr(c, "layers_block_type", None)
    bad: dict[str, list[int]] = {}
    sliding_ok = windowed(model_config) and not unsupported_layer_types(model_config)
    states_ok = recurrent_state.supported(model_config)
    indexed_ok = c.model_type in INDEXERS.values()
    for i, layer in enumerate(DynamicCache(config=model_config).layers):
        if type(layer) is DynamicSlidingWindowLayer and sliding_ok:
            continue  # kept whole; window_masks.py windows the attention
        if type(layer) is DynamicIndexedLayer and indexed_ok:
            continue  # GrowingIndexedLayer keeps its indexer keys beside the KV
        if (type(layer) is LinearAttentionLayer and states_ok) or type(layer) is DummyLayer:
            continue  # recurrent_state.py keeps it per row; a dummy layer holds nothing
        if type(layer) is not DynamicLayer:
            bad.setdefault(type(layer).__name__, []).append(i)
    if not bad:
        return
    cls, layers = next(iter(bad.items()))
    named = f" ({kinds[layers[0]]!r} in layer_types)" if kinds else ""
    what = _UNSUPPORTED_LAYERS.get(cls, f"a {cls} cache")
    raise NotImplementedError(
        f"the built-in engine batches full-attention KV caches only, but layers {layers} of this {c.model_type!r} "
        f"model are {what}{named}, which it does not support; serve this model with SGLang "
        "and point rollout.engine_urls at it")


def bytes_per_token(model) -> int:
    """Bytes one token's cache entry takes across all layers: its keys and values (MLA: its compressed
    latent) and, in DSA layers that run an indexer, its indexer key. Checked against what the cache
    holds after a forward in tests/unit/engine/test_kv_cache.py."""
    c = model.config
    c = getattr(c, "get_text_config", lambda: c)()
    if getattr(c, "kv_lora_rank", None):
        # MLA (DeepSeek-V3/Kimi, GLM-5): transformers (5.x) caches the compressed latent, one head of
        # the normalised KV latent (keys' slot) and the shared rotary key (values' slot), and expands
        # it into per-head keys and values at each attention.
        per_layer = c.kv_lora_rank + c.qk_rope_head_dim
    else:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        per_layer = 2 * kv_heads * head_dim
    indexer = len(indexer_layers(model.config)) * getattr(c, "index_head_dim", 0)  # DSA: one key per indexer layer
    itemsize = next(model.parameters()).element_size()
    # A hybrid model's recurrent layers keep a fixed state per row, not KV per token.
    return (kv_layers(model.config) * per_layer + indexer) * itemsize


def tokens_in(megabytes: float, model) -> int:
    """How many tokens of this model's KV fit in `megabytes`."""
    return int(megabytes * 2**20) // bytes_per_token(model)


def budget_tokens(model, device, fraction: float, prefix_cache_mb: float, context_length: int) -> int:
    """Tokens of running-batch KV an engine may hold within `fraction` of `device`'s memory, after its
    weights and its prefix cache. Refuses (ConfigError) an engine that could not hold its weights and one
    full-context sequence: it would fail mid-run rather than at start."""
    total = total_memory(device)
    budget = fraction * total
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    gib = 2**30
    fix = ("raise rollout.engine.memory_fraction, serve in a smaller dtype (rollout.engine.dtype = 'bfloat16'), "
           "lower prefix_cache_mb or context_length, or use a device with more memory")
    if weights > budget:
        raise ConfigError(f"engine: the model's weights take {weights / gib:.2f} GiB, more than memory_fraction = "
                          f"{fraction:g} of the {device} device's {total / gib:.2f} GiB ({budget / gib:.2f} GiB): {fix}")
    per_token = bytes_per_token(model)
    tokens = int(budget - weights - prefix_cache_mb * 2**20) // per_token
    if tokens < context_length:
        raise ConfigError(f"engine: after its weights ({weights / gib:.2f} GiB) and prefix cache ({prefix_cache_mb:g} MiB), "
                          f"memory_fraction = {fraction:g} of the {device} device's {total / gib:.2f} GiB leaves KV for "
                          f"{max(tokens, 0)} tokens, fewer than one sequence of context_length = {context_length}: {fix}")
    return tokens


def select_rows(cache, idx: torch.Tensor, start: int = 0) -> None:
    """Keep rows `idx` (in that order) of every layer, and of the KV layers only columns from `start`."""
    for layer in cache.layers:
        if recurrent_state.is_state_layer(layer):
            recurrent_state.select_rows(layer, idx)
        elif isinstance(layer, GrowingLayer):
            layer.select(idx, start)
        elif not isinstance(layer, DummyLayer):
            layer.assign(*(t[idx, ..., start:, :] for t in layer.streams()))


def row_kv(cache, mask: torch.Tensor, i: int, a: int, b: int) -> tuple[torch.Tensor, ...]:
    """Row i's cache entries for its real tokens [a, b); mask is (B, L). Keys and values, each
    (layers, H, b - a, D), then for a DSA model its indexer layers' keys (indexer layers, 1, b - a,
    D_index): the prefix cache's entries (prefix_cache.py)."""
    cols = mask[i].nonzero().squeeze(1)[a:b]
    out = (torch.stack([layer.keys[i][:, cols] for layer in cache.layers]),
           torch.stack([layer.values[i][:, cols] for layer in cache.layers]))
    indexed = [layer for layer in cache.layers if isinstance(layer, GrowingIndexedLayer)]
    if indexed:
        out += (torch.stack([layer.indexer_keys[i][cols] for layer in indexed])[:, None],)
    return out


def load_prefixes(cache, hits: list[Match], cached: list[int], M: int) -> None:
    """Fill an empty `cache` with each row's cached prefix (cached[i] tokens of hits[i]), right-aligned
    at column M; rows with nothing cached get zero columns there."""
    parts = None  # as row_kv's entries, a row axis added: each (layers, R, H, M, D)
    for i, (h, c) in enumerate(zip(hits, cached)):
        if not c:
            continue
        entry = PrefixCache.gather(h)  # each (layers, H, c, D); MLA's values are narrower than its keys
        if parts is None:
            parts = [t.new_zeros((t.shape[0], len(hits), t.shape[1], M, t.shape[3])) for t in entry]
        for p, t in zip(parts, entry):
            p[:, i, :, M - c:] = t
    K, V, *index = parts
    for layer_idx in range(K.shape[0]):
        cache.update(K[layer_idx], V[layer_idx], layer_idx)
    indexed = [j for j, layer in enumerate(cache.layers) if isinstance(layer, GrowingIndexedLayer)]
    for n, layer_idx in enumerate(indexed):
        cache.update_indexer(index[0][n][:, 0], layer_idx)  # after the layer's KV, as the model does


class BatchKV:
    """The running batch's per-row tensors, kept aligned row for row: its KV, its attention mask, each
    row's next position and next input token. Empty (all None) when no row is running."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.cache = None  # DynamicCache of GrowingLayers, each (B, H, L, D) (+ (B, L, D_index) in DSA layers)
        self.mask: torch.Tensor | None = None  # (B, L) 1 = real token
        self.next_pos: torch.Tensor | None = None  # (B,) position of the next input token
        self.last_tokens: torch.Tensor | None = None  # (B,) next input token

    def merge(self, cache, mask: torch.Tensor, lens: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append rows (a prefill's cache, mask (R, L'), prompt lengths (R,), first tokens (R,)) below
        the running ones, left-padding whichever side is shorter."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
            self.next_pos, self.last_tokens = lens.clone(), tokens
            return
        L_old, L_new = self.mask.shape[1], mask.shape[1]
        L = max(L_old, L_new)
        for old, new in zip(self.cache.layers, cache.layers):
            if recurrent_state.is_state_layer(old):
                recurrent_state.append_rows(old, new)
                continue
            if isinstance(old, DummyLayer):
                continue
            old.assign(*(torch.cat([_left_pad(a, L - L_old), _left_pad(b, L - L_new)], dim=0)
                         for a, b in zip(old.streams(), new.streams())))
        self.mask = torch.cat([_left_pad(self.mask, L - L_old, dim=-1), _left_pad(mask, L - L_new, dim=-1)], dim=0)
        self.next_pos = torch.cat([self.next_pos, lens])
        self.last_tokens = torch.cat([self.last_tokens, tokens])

    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (non-empty, in order). Copies the whole batch's KV."""
        idx = torch.tensor(keep, device=self.mask.device)
        mask = self.mask[idx]
        # Drop leading columns that are padding for every remaining row, so the cache does not grow
        # with the longest prompt that ever passed through.
        start = int(mask.any(dim=0).nonzero()[0])
        select_rows(self.cache, idx, start)
        self.mask = mask[:, start:]
        self.next_pos = self.next_pos[idx]
        self.last_tokens = self.last_tokens[idx]

    def row_kv(self, i: int, a: int, b: int) -> tuple[torch.Tensor, ...]:
        return row_kv(self.cache, self.mask, i, a, b)


def _left_pad(t: torch.Tensor, n: int, dim: int = -2) -> torch.Tensor:
    """Pad `n` zeros in front of the sequence dim: -2 for (B, H, L, D) KV and (B, L, D) indexer keys,
    -1 for (B, L) masks."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)
