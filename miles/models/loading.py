"""Load a causal LM and its tokenizer from a local checkpoint directory or a hub id.

The tiny presets and real checkpoints (e.g. Qwen3-0.6B) go through exactly this code. Nothing is
downloaded unless the caller passes a hub id and the machine can reach the hub.
Non-goal: sharding or parallel layouts; the trainer backends apply those after loading.
"""

from __future__ import annotations

import os
from pathlib import Path

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def torch_dtype(name: str):
    import torch

    try:
        return getattr(torch, DTYPES[name])
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(DTYPES)}") from None


def check_model_path(path: str) -> None:
    """Fail early, naming the fix, when a local model directory is unusable."""
    p = Path(path)
    looks_local = p.exists() or path.startswith((".", "/", "~")) or os.sep in path and not _is_hub_id(path)
    if not looks_local:
        return
    if not p.is_dir():
        raise FileNotFoundError(
            f"model directory {path!r} does not exist: build one with "
            f"`miles init-model --preset tiny-qwen3 --out {path}` or point to a checkpoint directory")
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{path!r} has no config.json: it is not a Hugging Face checkpoint directory")


def _is_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not Path(path).exists()


def load_model(path: str, dtype: str = "float32", device: str = "cpu"):
    """AutoModelForCausalLM.from_pretrained with eager-friendly defaults for CPU."""
    from transformers import AutoModelForCausalLM

    check_model_path(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), attn_implementation="sdpa")
    return model.to(device)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    check_model_path(path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
