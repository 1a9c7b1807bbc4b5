"""Tiny real models for tests whose outputs must vary (greedy decoding that can tell models apart)."""

from __future__ import annotations


def build_varied_tiny_model(out, seed: int = 1) -> str:
    """The tiny-qwen3 preset at `out` with larger random weights (std 0.1, drawn from `seed`).

    The preset's default init gives near-uniform logits, so greedy decoding repeats one token and a
    test comparing token sequences could not fail; std 0.1 gives varied, EOS-containing outputs.
    """
    import torch

    from miles.models.loading import load_model, load_tokenizer
    from miles.models.presets import build_tiny_model

    build_tiny_model("tiny-qwen3", out)
    model, tok = load_model(str(out)), load_tokenizer(str(out))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
