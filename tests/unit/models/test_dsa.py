"""GLM-5's DSA indexer as miles loads it (models/dsa.py): the scores are transformers' own, the keys
kept are transformers' choice wherever the k-th and (k+1)-th scores differ, and among tied scores the
earliest keys; so a cached decode keeps the keys the full forward keeps, token for token."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from miles.models.dsa import index_scores, indexer_layers
from miles.models.loading import load_model


def _indexer_calls(model, ids: list[int]) -> list[tuple]:
    """(indexer, args, kwargs) of every indexer call in one full forward over `ids`, without the cache
    (calling an indexer again must not append its keys twice)."""
    calls, handles = [], []
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            handles.append(layer.self_attn.indexer.register_forward_pre_hook(
                lambda m, a, kw: calls.append((m, a, {**kw, "cache": None})), with_kwargs=True))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in handles:
        h.remove()
    return calls


def test_the_indexer_keeps_transformers_choice_and_the_earliest_keys_among_ties(preset_dir):
    model = load_model(preset_dir("tiny-glm5")).eval()
    tied = 0
    for m, args, kwargs in _indexer_calls(model, list(range(3, 23))):
        theirs = type(m).forward(m, *args, **kwargs)[0]  # transformers' forward: topk  (S, k)
        ours = m(*args, **kwargs)[0]
        scores = index_scores(m, *args[:4])[0]  # (S, T)
        k = ours.shape[-1]
        for q in range(scores.shape[0]):
            row, chosen = scores[q], set(ours[q].tolist())
            kth = row.sort(descending=True).values[k - 1]
            above = set((row > kth).nonzero().squeeze(1).tolist())
            ties = (row == kth).nonzero().squeeze(1).tolist()
            if len(above) + len(ties) == k:  # no key left out at the k-th score: transformers' choice
                assert chosen == set(theirs[q].tolist())
            elif torch.isfinite(kth):  # keys left out share the k-th score: the earliest are kept
                tied += 1
                assert chosen == above | set(ties[:k - len(above)])
            else:  # fewer keys visible than k: all of them, and masked columns attention never reads
                assert above <= chosen
    assert tied, "no query had tied scores at its k-th key: the tie rule went untested"


def test_a_cached_decode_keeps_the_keys_the_full_forward_keeps(preset_dir):
    """transformers' own cached decode, with miles' indexer, gives the full forward's greedy ids and
    logprobs (with transformers' topk its 12th token's logprob is 0.14 off and the ids part there)."""
    model = load_model(preset_dir("tiny-glm5")).eval()
    prompt, n = list(range(20, 30)), 12
    full, full_lp = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            lp = model(input_ids=torch.tensor([full])).logits[0, -1].log_softmax(-1)
            full.append(int(lp.argmax()))
            full_lp.append(float(lp[full[-1]]))
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits
        decoded, lps = list(prompt), []
        for _ in range(n):
            lp = logits[0, -1].log_softmax(-1)
            decoded.append(int(lp.argmax()))
            lps.append(float(lp[decoded[-1]]))
            logits = model(input_ids=torch.tensor([[decoded[-1]]]), cache=cache, use_cache=True).logits
    assert decoded == full
    assert max(abs(a - b) for a, b in zip(lps, full_lp)) <= 1e-5


def test_indexer_layers_are_those_running_their_own_indexer(preset_dir):
    from transformers import AutoConfig

    assert indexer_layers(AutoConfig.from_pretrained(preset_dir("tiny-glm5"))) == [0, 1, 3]  # layer 2 is "shared"
    assert indexer_layers(AutoConfig.from_pretrained(preset_dir("tiny-deepseek-v3"))) == []
