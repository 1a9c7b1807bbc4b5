"""DeepSeek sparse attention as GLM-5 (`glm_moe_dsa`) runs it in miles: which layers run the lightning
indexer, and its top-k with ties broken by position.

In each DSA layer the indexer scores every key a query may see, sum over its heads h of
w_h * relu(q_h . k), and attention keeps only the `index_topk` best keys. Scores tie exactly whenever
every head's dot product is negative (the ReLU makes them all 0), and transformers' `topk` breaks ties
as its kernel happens to for the row at hand: a full forward (a row of T keys per query) and a cached
decode (one query, the keys so far) keep different keys among the tied ones. On tiny-glm5 (prompt
20..29) transformers' own cached decode parts from its own full forward at the 12th greedy token, whose
logprob is 0.14 off. The engine decodes against its cache while the trainer
scores the whole sequence, so miles keeps, among equal scores, the earliest keys (the lowest columns;
columns follow positions in every layout miles builds): the choice then depends on the scores alone,
and the engine agrees with the full forward.

The replacement forward (`_forward`) computes the scores with the same operations as transformers'
`GlmMoeDsaIndexer.forward` (models/glm_moe_dsa/modeling_glm_moe_dsa.py) and replaces only its last
line, `index_scores.topk(...)`, by a stable sort. `models/loading.py` (and the trainer's parallel
loader) installs it on every model miles loads (engine, trainer, reference), so no forward in a run
picks differently.
Non-goals: DeepSeek-V3.2's indexer (non-interleaved rotary; the engine refuses that family), kernels
that take the indices directly (flash-mla).
"""

from __future__ import annotations

import sys
import types

# The indexer classes `stable_topk` replaces the forward of: class name -> model type.
INDEXERS = {"GlmMoeDsaIndexer": "glm_moe_dsa"}


def indexer_layers(model_config) -> list[int]:
    """Layers that run their own indexer, and so keep an indexer key per token (GLM-5's `"shared"`
    layers reuse the previous indexer layer's top-k and keep none); empty for a model without DSA."""
    c = model_config.get_text_config()
    if "indexed_attention" not in (getattr(c, "layer_types", None) or ()):
        return []
    kinds = getattr(c, "indexer_types", None) or ["full"] * c.num_hidden_layers
    return [i for i, (layer, kind) in enumerate(zip(c.layer_types, kinds))
            if layer == "indexed_attention" and kind == "full"]


def stable_topk(model) -> None:
    """Make every DSA indexer of `model` keep the earliest keys among equal scores (see module doc)."""
    for m in model.modules():
        if type(m).__name__ in INDEXERS:
            m.forward = types.MethodType(_forward, m)
            # Rotary as the class's own module applies it (GLM-5: interleaved pairs).
            m._rotary = sys.modules[type(m).__module__].apply_rotary_pos_emb_interleave


def index_scores(self, hidden_states, q_resid, position_embeddings, attention_mask, cache=None):
    """(B, S, T) index scores of `self` (a GlmMoeDsaIndexer) for S queries over the T keys the cache
    then holds, masked keys at -inf (a bool mask) or offset by the additive mask; appends the S new
    indexer keys to `cache`. Operation for operation transformers' forward, so the scores are its
    scores bit for bit. Call it under no_grad, as transformers does: the indexer only selects."""
    import torch  # deferred: models/loading.py is on the config-loading path

    B, S, _ = hidden_states.shape
    cos, sin = position_embeddings
    rope = self.qk_rope_head_dim
    q = self.wq_b(q_resid).view(B, S, self.n_heads, self.head_dim)  # (B, S, H, D)
    q_rot, q_pass = torch.split(q, [rope, self.head_dim - rope], dim=-1)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)  # (B, S, 1, D): one key head
    k_rot, k_pass = torch.split(k, [rope, self.head_dim - rope], dim=-1)
    q_rot, k_rot = self._rotary(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # (B, S, D)
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)  # (B, T, D)
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (self.n_heads ** -0.5)
    out = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # (B, S, T): heads summed by their weights
    if attention_mask.dtype == torch.bool:
        return out.masked_fill(~attention_mask, float("-inf"))
    return out + attention_mask


def _forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None):
    """GlmMoeDsaIndexer.forward with ties kept in column order: (B, S, topk) int32 key indices."""
    import torch

    with torch.no_grad():
        scores = index_scores(self, hidden_states, q_resid, position_embeddings, attention_mask, cache)
        k = min(self.index_topk, scores.shape[-1])
        # A stable descending sort keeps equal scores in column order, so the first k are the best keys
        # and, among equal ones, the earliest. O(T log T) per query where topk is O(T): the indexer's
        # matmuls over T keys and H heads dominate either way.
        return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k].to(torch.int32)
