"""Recurrent state of linear-attention and Mamba layers, kept per row of the running batch.

Hybrid models (Qwen3-Next's and Qwen3.5's gated delta-net layers, Nemotron-H's Mamba-2 blocks) interleave
full-attention layers, whose KV grows a column per token (kv_cache.py), with layers that carry a
fixed-size state per sequence instead: a conv state (B, channels, kernel) holding the last inputs of
the short causal convolution and a recurrent/SSM state (B, heads, ...) summarising everything before.
transformers keeps both in a `LinearAttentionLayer` of its cache; the engine keeps that object and
edits its states row for row as the batch changes:
  * a prefill computes each row's states from nothing: rows are left-padded, and these families zero
    the hidden states at padding (`apply_mask_to_padding_states`) before projecting them, so a
    padding column feeds zero keys/values (zero B·x) into a zero state, leaving it zero; the row's
    states are then what an unpadded forward of its prompt leaves (gated delta-net layers compute each
    row over its own tokens, and keep the state at the row's last chunk boundary and the partial
    chunk's inputs instead: delta_step.py);
  * merging appends the new rows' states below the running ones (no padding: a state has no length);
  * compaction and deduplicated prompts select rows.

Prefix caching: a state after k tokens cannot be cut out of the state after n > k tokens, and the
engine does not snapshot states at block boundaries, so rows of such models always compute their whole
prompt (`ModelRunner` turns the prefix cache off for them and logs why).
Non-goals: states at block boundaries for prefix reuse; the static-KV decode path (fast_decode.py
refuses these model types by name).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

# Model types whose recurrent layers are exact under the engine's left padding (they zero padded hidden
# states before the convolution and the scan), checked against transformers' unpadded forward in
# tests/unit/engine/test_engine_recurrent.py. Others holding recurrent state stay refused.
PADDING_EXACT = {"qwen3_next": "gated delta-net", "qwen3_5_moe_text": "gated delta-net", "nemotron_h": "Mamba-2"}


def is_state_layer(layer) -> bool:
    """Whether a cache layer holds recurrent state (conv + recurrent) rather than per-token KV."""
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def has_recurrent_state(model_config) -> bool:
    """Whether any layer of the model keeps recurrent state instead of KV."""
    return any(is_state_layer(layer) for layer in DynamicCache(config=model_config).layers)


def supported(model_config) -> bool:
    """Whether the engine batches this model's recurrent layers exactly (PADDING_EXACT)."""
    return model_config.get_text_config().model_type in PADDING_EXACT


def bytes_per_row(model) -> int:
    """Bytes of recurrent state one row holds across the model's state layers, read off the cache of a
    one-token forward (the shapes depend on each family's heads, kernel and state sizes, not on length)."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), cache=cache, use_cache=True)
    return state_bytes(cache)


def state_bytes(cache) -> int:
    """Bytes of recurrent state `cache` holds, all rows and state layers together."""
    return sum(states[i].numel() * states[i].element_size()
               for layer in cache.layers if is_state_layer(layer) for states, i in _states(layer))


def _states(layer) -> list[tuple[dict, int]]:
    """(the dict holding it, its key) for every initialised state tensor of `layer`, the engine's
    gated delta-net partial chunk included (delta_step.py)."""
    out = []
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            out.append((layer.conv_states, i))
        if layer.is_recurrent_states_initialized[i]:
            out.append((layer.recurrent_states, i))
    part = getattr(layer, "partial_chunk", {})
    return out + [(part, key) for key in sorted(part)]


def select_rows(layer, idx: torch.Tensor) -> None:
    """Keep rows `idx` (in that order) of every state of `layer`."""
    for states, i in _states(layer):
        states[i] = states[i].index_select(0, idx.to(states[i].device))


def append_rows(old, new) -> None:
    """Append `new`'s rows (a prefill's layer) below `old`'s, state by state."""
    for (states, i), (new_states, _) in zip(_states(old), _states(new)):
        states[i] = torch.cat([states[i], new_states[i]], dim=0)
