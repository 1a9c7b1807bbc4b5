"""The engine's decode step of a Mamba-2 mixer, computing what the mixer's chunked form computes.

transformers runs a Mamba-2 mixer (Nemotron-H's) in two forms: over a sequence the chunked scan
(`mamba2_chunk_scan`: a full forward, so the trainer, and the engine's prefill), and for one token on a
cache a recurrent step (`mamba2_selective_state_update`: a decode step). The chunked form clamps each
token's time step softplus(dt + dt_bias) to the mixer's `time_step_limit` (Nemotron-H: from below at
`time_step_min`, 1e-3); the recurrent step does not clamp. For a token whose time step falls under the
floor the two forms are different models: on the tiny preset transformers' own cached decode is up to
7e-5 from its full forward in logprob, and the engine's rollout logprobs were up to 1.4e-4 from the
trainer's. The engine's step is transformers' recurrent step with the time step clamped first, so a
decode step computes what the trainer's full forward computes, within float32 rounding
(tests/unit/engine/test_engine_recurrent.py).

Only the single-token cached forward is replaced, on the engine's own model instance; prefill and every
other forward run transformers' mixer unchanged. Non-goals: other Mamba-2 families (the engine batches
recurrent layers only of the families in recurrent_state.PADDING_EXACT).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

# HF model type -> the class name of its Mamba-2 mixer, whose decode step the engine computes itself.
MIXERS = {"nemotron_h": "NemotronHMamba2Mixer"}


def install(model) -> int:
    """Route each Mamba-2 mixer's single-token cached forward through `decode_step`; returns how many mixers."""
    name = MIXERS.get(model.config.get_text_config().model_type)
    mixers = [m for m in model.modules() if type(m).__name__ == name]
    for mixer in mixers:
        mixer.forward = _with_decode_step(mixer, mixer.forward)
    return len(mixers)


def _with_decode_step(mixer, forward):
    def run(hidden_states, cache=None, attention_mask=None, **kwargs):
        i = mixer.layer_idx
        if (cache is not None and hidden_states.shape[1] == 1 and not cache.is_recording_past(i)
                and cache.get_conv_state(i) is not None and cache.get_recurrent_state(i) is not None):
            return decode_step(mixer, hidden_states, cache)
        return forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    return run


def decode_step(mixer, hidden_states: torch.Tensor, cache) -> torch.Tensor:
    """One token per row (B, 1, hidden) through `mixer` on `cache`'s states (updated in place): transformers'
    recurrent step, its own conv and state-update functions, with the chunked form's clamped time step."""
    fns = sys.modules[type(mixer).__module__]  # the model's own helpers (hub kernels where installed)
    B, dtype = hidden_states.shape[0], hidden_states.dtype
    H, P, G, N = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    i = mixer.layer_idx
    gate, xBC, dt = mixer.in_proj(hidden_states).split([mixer.intermediate_size, mixer.conv_dim, H], dim=-1)
    xBC = fns.causal_conv1d_update(xBC.transpose(1, 2), cache.get_conv_state(i), mixer.conv1d.weight.squeeze(1),
                                   mixer.conv1d.bias, activation=mixer.activation).transpose(1, 2)  # (B, 1, conv_dim)
    x, Bs, Cs = torch.split(xBC, [mixer.intermediate_size, G * N, G * N], dim=-1)
    # The time step as mamba2_chunk_scan computes it, softplus(dt + dt_bias) clamped to the limit, laid out
    # (B, H, P) as transformers' step lays it out before its softplus (torch's softplus over another
    # layout can round differently in the last bit), so an unclamped step is transformers' own to the bit.
    lo, hi = mixer.time_step_limit
    dt = dt.transpose(1, 2).expand(-1, -1, P) + mixer.dt_bias[:, None].expand(-1, P).to(dt.dtype)
    dt = F.softplus(dt).clamp(min=lo, max=hi)
    A = -torch.exp(mixer.A_log.float())[:, None, None].expand(-1, P, N)
    y = fns.mamba2_selective_state_update(
        cache.get_recurrent_state(i), x.view(B, H, P), dt, A, Bs.view(B, G, N), Cs.view(B, G, N),
        mixer.D[:, None].expand(-1, P), z=None, dt_bias=None, dt_softplus=False)  # (B, H, P)
    y = mixer.norm(y.view(B, 1, -1), gate)
    return mixer.out_proj(y.to(dtype))
