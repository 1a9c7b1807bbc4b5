"""Teacher-forced logprobs of given tokens under a causal LM.

The convention matches the built-in engine: log_softmax(logits / T) in float32 for T > 0 and plain
log_softmax(logits) for greedy (T == 0), before any top-p/top-k truncation.
"""

from __future__ import annotations

import contextlib
import time

import torch

from miles.trainer import packed_attention
from miles.trainer.chunked_logprobs import token_logprobs_chunked
from miles.trainer.types import TokenOutputs, TokenRequest


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """Logprob of each next token: out[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1]). (B, T-1)"""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)
    logits = logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return torch.gather(logp, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def forward_logprobs(model, input_ids, attention_mask=None, position_ids=None, temperature: float = 1.0,
                     with_entropy: bool = False, images=None, packed=None):
    """Next-token logprobs (B, T-1) and, if asked, the per-token entropy (B, T-1) of the same
    tempered distribution. Packed rows pass position_ids and no attention_mask; the model then
    keeps each packed sequence's attention to itself (by `packed`, the micro-batch's Plan, when the
    model runs packed_attention.py's attention). `images`: a vision-language micro-batch's
    ImageBatch (trainer/vision.py)."""
    if packed is not None and images is None and packed_attention.active(model):
        return logprobs_from_logits(packed_attention.logits(model, input_ids, position_ids, packed), input_ids,
                                    temperature, with_entropy)
    with images.spliced_into(model) if images is not None else contextlib.nullcontext():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits  # (B, T, V)
    return logprobs_from_logits(logits, input_ids, temperature, with_entropy)


# Families whose decoder keeps every earlier token's keys and values in a plain KV cache (no sliding
# window, no recurrent state, no MoE routes to replay), so rows continuing a prompt's cached KV see
# what their whole sequences would.
PROMPT_KV_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def shares_prompt_kv(config) -> bool:
    """Whether a model of this HF config can compute shared prompts once (`shared_prompt_logits`)."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return getattr(config, "model_type", None) in PROMPT_KV_FAMILIES and not window


def shared_prompt_logits(model, mb) -> torch.Tensor:
    """The logits (B, T, V) of a micro-batch whose rows share prompts (batching.SharedPrompts): each
    prompt's forward once, its KV handed to every row that continues it, then the rows' forward on top.
    The same logits as the rows' whole sequences (attention sees the same keys; a padded prompt slot is
    masked, and positions are given), for a prompt's compute once per micro-batch instead of once per
    sample. Gradients reach the prompts' tokens through the shared KV, summed over their rows."""
    sp = mb.shared
    G, P = sp.input_ids.shape
    positions = torch.arange(P, device=sp.input_ids.device).expand(G, P)
    # Padding on the right of a prompt: no query ever sees only masked keys (which would give NaNs
    # that the rows' attention then multiplies by zero weights).
    prompts = model(input_ids=sp.input_ids, attention_mask=sp.attention_mask, position_ids=positions,
                    use_cache=True, logits_to_keep=1)
    kv = prompts.past_key_values
    kv.batch_select_indices(sp.row_prompt)  # (G, ...) -> (B, ...), differentiable indexing
    mask = torch.cat([sp.attention_mask[sp.row_prompt], mb.attention_mask], dim=1)  # (B, P + T)
    return model(input_ids=mb.input_ids, attention_mask=mask, position_ids=mb.position_ids, cache=kv,
                 use_cache=True).logits  # (B, T, V)


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                         with_entropy: bool = False):
    """`forward_logprobs` from the model's logits (B, T, V): the tokens' logprobs (B, T-1) and, if
    asked, the entropy (B, T-1), in float32 at `temperature`. Computed a chunk of tokens at a time
    (chunked_logprobs.py), so no float32 copy of the whole logits is ever held."""
    # Every position is scored against the next token (the last against a dummy 0, then dropped):
    # flattening the whole (B, T, V) logits is a view, where cutting the last position first would copy.
    targets = torch.cat([input_ids[:, 1:], input_ids.new_zeros((input_ids.shape[0], 1))], dim=1)  # (B, T)
    logp, entropy = token_logprobs_chunked(logits, targets, temperature, with_entropy)
    return logp[:, :-1], (entropy[:, :-1] if with_entropy else None)


def run_micro_batches(logits_of, backward, micro_batches, loss_fn, request: TokenRequest,
                      forward_only: bool = False, around_forward=None) -> tuple[float, float]:
    """`Backend.forward_backward` for a backend whose forward returns the whole vocabulary's logits
    (FSDP, a plain module): one micro-batch after another, forward (`logits_of(mb)` (B, T, V)), the
    token outputs, the loss, its backward (`backward(loss)`). Returns (forward s, backward s)."""
    fwd_s = bwd_s = 0.0
    for mb in micro_batches:
        t0 = time.perf_counter()
        with around_forward(mb) if around_forward is not None else contextlib.nullcontext():
            logits = logits_of(mb)  # (B, T, V)
        logp, entropy = logprobs_from_logits(logits, mb.input_ids, request.temperature, request.entropy)
        out = TokenOutputs(logp, entropy)
        if request.greedy:
            out.greedy = logits[:, :-1].argmax(-1) == mb.input_ids[:, 1:]  # (B, T-1)
        loss = loss_fn(mb, out)
        t1 = time.perf_counter()
        fwd_s += t1 - t0
        if not forward_only:
            backward(loss)
            bwd_s += time.perf_counter() - t1
    return fwd_s, bwd_s
