"""The engine's forward of a gated delta-net layer (Qwen3-Next, Qwen3.5), computing what the trainer's
full forward computes at each position.

transformers runs the gated delta rule in two forms: over a sequence the chunked form
(`torch_chunk_gated_delta_rule`: chunks of 64 tokens from the sequence's first, the last one padded with
zeros; a full forward, so the trainer), and for one token on a cache the recurrent form (a decode step).
The two round differently in float32, and these models amplify it (head outputs are sums that cancel,
then a gated RMSNorm scales them to unit size): on the tiny presets transformers' cached decode is up to
1.9e-5 from its full forward in logprob. A left-padded batched prefill shifts a row's chunks too.

The engine's forward computes every position as the full forward's chunked form does:
  * prefill: each row's convolution and chunks over its own tokens, from its first (not the padded
    batch's first column);
  * decode: the cache's recurrent state is each row's state at its last chunk boundary, and beside it
    the layer keeps the inputs of the row's current, partial chunk (`partial_chunk`: q, k, v, g, beta
    after the convolution, zeros past the row's `fill`). A step appends the new token's inputs and runs
    the chunked form over that chunk from the boundary state; the new token's output is the full
    forward's at that position (later positions of a chunk do not reach earlier ones: masked to exact
    zeros). When the chunk fills, its final state becomes the boundary state. The convolution of the
    new token is transformers' full-sequence convolution over its last `kernel` inputs, computed as
    an inner position of a sequence (`_conv`);
  * every linear layer of the model computes a multiple of ROWS rows (zero rows added, then dropped):
    CPU BLAS computes a product's rows in groups of 4 and rounds the 1 to 3 left over another way
    (a matrix-vector path), so a decode step's few rows would round unlike the same rows of the full
    forward, which are (but for its last few) in groups.
Cost: a decode step computes a chunk's worth of positions per layer rather than one, and each row keeps
a chunk's inputs per layer beside its state (counted in its KV budget, recurrent_state.py). Measured in
tests/unit/engine/test_engine_recurrent.py. Installed per model instance, on the engine's
own model only. Non-goals: hub kernels (fla) in place of transformers' torch functions.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn.functional as F

# HF model type -> the class name of its gated delta-net layer, whose forward the engine computes itself.
LAYERS = {"qwen3_next": "Qwen3NextGatedDeltaNet", "qwen3_5_moe_text": "Qwen3_5MoeGatedDeltaNet"}
CHUNK = 64  # torch_chunk_gated_delta_rule's chunk size
TAIL = 16  # zero tokens after a convolution's or an activation's input (see _conv)
ROWS = 4  # a CPU matrix product computes rows in groups of 4: rows left over (1 to 3) round another way
_NEEDS = ("apply_mask_to_padding_states", "causal_conv1d_fn", "torch_chunk_gated_delta_rule")


def install(model) -> int:
    """Route each gated delta-net layer's forward through the engine's (prefill, decode_step) and, in a
    model that has such layers, every linear layer's through `_in_row_groups`; returns how many layers."""
    name = LAYERS.get(model.config.get_text_config().model_type)
    layers = [m for m in model.modules() if type(m).__name__ == name]
    for layer in layers:
        fns = sys.modules[type(layer).__module__]
        missing = [f for f in _NEEDS if not hasattr(fns, f)]
        if missing or inspect.signature(fns.torch_chunk_gated_delta_rule).parameters["chunk_size"].default != CHUNK:
            raise RuntimeError(f"delta_step: {name}'s module changed ({missing or 'chunk size'}); "
                               "the engine's gated delta-net forward relies on it")
        layer.forward = _engine_forward(layer, fns)
    if layers:
        for linear in model.modules():
            if type(linear) is torch.nn.Linear:
                linear.forward = _in_row_groups(linear)
    return len(layers)


def _in_row_groups(linear):
    """`linear`'s forward over a multiple of ROWS rows (zero rows added, their outputs dropped), so a
    decode step's few rows round as a sequence's do."""
    def run(x):
        rows = x.numel() // x.shape[-1]
        extra = -rows % ROWS
        if not extra:
            return F.linear(x, linear.weight, linear.bias)
        out = F.linear(F.pad(x.reshape(rows, -1), (0, 0, 0, extra)), linear.weight, linear.bias)
        return out[:rows].reshape(*x.shape[:-1], -1)
    return run


def _engine_forward(layer, fns):
    def run(hidden_states, cache=None, attention_mask=None, **kwargs):
        if (cache is not None and hidden_states.shape[1] == 1
                and cache.get_recurrent_state(layer.layer_idx) is not None):
            return decode_step(layer, fns, hidden_states, cache)
        return prefill(layer, fns, hidden_states, cache, attention_mask)
    return run


def _project(layer, h):
    """(mixed q|k|v (B, S, conv_dim), z (B, S, Hv, dv), b, a (B, S, Hv)) as the family's forward projects them."""
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key head
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(h), layer.in_proj_ba(h))
        mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
        return mixed, z, b, a
    B, S, _ = h.shape
    return (layer.in_proj_qkv(h), layer.in_proj_z(h).reshape(B, S, -1, layer.head_v_dim),
            layer.in_proj_b(h), layer.in_proj_a(h))


def _conv(layer, fns, x):
    """transformers' full-sequence causal convolution of x (B, conv_dim, S), as (B, S, conv_dim). torch's
    vectorised kernels (the convolution, softplus, sigmoid) round a tensor's last few elements unlike the
    others; a position the engine computes is seldom among the last few of the trainer's sequence, so x
    is followed by TAIL zero tokens (their outputs dropped) and computed as an inner one."""
    S = x.shape[-1]
    return fns.causal_conv1d_fn(F.pad(x, (0, TAIL)), layer.conv1d.weight.squeeze(1), layer.conv1d.bias,
                                activation=layer.activation)[..., :S].transpose(1, 2)


def _inputs(layer, conv_out, b, a):
    """The chunked form's per-token inputs, packed (B, S, width): q | k | v | g | beta, in g's dtype.
    g and beta are computed with TAIL zero tokens after (see _conv)."""
    S = a.shape[1]
    a, b = (F.pad(t, (0, 0, 0, TAIL)) for t in (a, b))
    g = (-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias))[:, :S]
    return torch.cat([conv_out.to(g.dtype), g, b.sigmoid()[:, :S].to(g.dtype)], dim=-1)


def _chunked(layer, fns, inputs, state):
    """The chunked form over packed `inputs` (B, S, width) from `state` (None: zeros): (out (B, S, Hv, dv),
    final state)."""
    B, S, _ = inputs.shape
    kd, vd, Hv = layer.key_dim, layer.value_dim, layer.num_v_heads
    q, k, v, g, beta = inputs.split([kd, kd, vd, Hv, Hv], dim=-1)
    return fns.torch_chunk_gated_delta_rule(
        q.reshape(B, S, -1, layer.head_k_dim), k.reshape(B, S, -1, layer.head_k_dim),
        v.reshape(B, S, -1, layer.head_v_dim), g=g, beta=beta, initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True)


def _finish(layer, out, z, dtype):
    """Gated RMSNorm and the output projection, as transformers' forward ends."""
    B, S = z.shape[:2]
    out = layer.norm(out.to(dtype).reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
    return layer.out_proj(out.reshape(B, S, -1))


def prefill(layer, fns, hidden_states, cache, attention_mask):
    """A multi-token forward from no state, rows left-padded (`attention_mask` (B, S), None: none is):
    each row's convolution and chunks over its own tokens; stores the conv state, the boundary state and
    the partial chunk."""
    h = fns.apply_mask_to_padding_states(hidden_states, attention_mask)
    B, S, _ = h.shape
    mixed, z, b, a = _project(layer, h)
    lens = attention_mask.sum(-1).tolist() if attention_mask is not None else [S] * B
    out = hidden_states.new_zeros(B, S, layer.num_v_heads, layer.head_v_dim)
    boundary, partial = [], []
    for r, n in enumerate(lens):
        conv = _conv(layer, fns, mixed[r:r + 1, S - n:].transpose(1, 2))
        inputs = _inputs(layer, conv, b[r:r + 1, S - n:], a[r:r + 1, S - n:])  # (1, n, width)
        o, final = _chunked(layer, fns, inputs, None)
        out[r, S - n:] = o[0].to(out.dtype)
        m = n - n % CHUNK  # the row's last chunk boundary
        if m == n:
            boundary.append(final)
        else:
            boundary.append(_chunked(layer, fns, inputs[:, :m], None)[1] if m else torch.zeros_like(final))
        partial.append(F.pad(inputs[0, m:], (0, 0, 0, CHUNK - (n - m))))
    if cache is not None:
        cache.update_conv_state(mixed.transpose(1, 2), layer.layer_idx, conv_kernel_size=layer.conv_kernel_size)
        cache.update_recurrent_state(torch.cat(boundary), layer.layer_idx)
        fill = torch.tensor([n % CHUNK for n in lens], device=h.device)
        cache.layers[layer.layer_idx].partial_chunk = {"inputs": torch.stack(partial), "fill": fill}
    return _finish(layer, out, z, hidden_states.dtype)


def decode_step(layer, fns, hidden_states, cache):
    """One token per row (B, 1, hidden) on `cache`'s states (updated in place): the chunked form over each
    row's partial chunk from its boundary state."""
    i, B = layer.layer_idx, hidden_states.shape[0]
    mixed, z, b, a = _project(layer, hidden_states)
    conv_state = cache.get_conv_state(i)  # (B, conv_dim, kernel): the last inputs
    conv_state.copy_(torch.cat([conv_state[..., 1:], mixed.transpose(1, 2).to(conv_state.dtype)], dim=-1))
    conv = _conv(layer, fns, conv_state)[:, -1:]
    part = cache.layers[i].partial_chunk
    rows, fill = torch.arange(B, device=hidden_states.device), part["fill"]
    part["inputs"][rows, fill] = _inputs(layer, conv, b, a)[:, 0]
    out, final = _chunked(layer, fns, part["inputs"], cache.get_recurrent_state(i))
    out = out[rows, fill][:, None]  # (B, 1, Hv, dv)
    fill += 1
    full = fill == CHUNK  # (B,) rows whose chunk is complete: its final state is their next boundary
    state = cache.get_recurrent_state(i)
    state.copy_(torch.where(full[:, None, None, None], final.to(state.dtype), state))
    part["inputs"].masked_fill_(full[:, None, None], 0)
    fill.masked_fill_(full, 0)
    return _finish(layer, out, z, hidden_states.dtype)
