"""Load a causal LM and its tokenizer from a local checkpoint directory or a hub id.

The tiny presets and real checkpoints (e.g. Qwen3-0.6B) go through exactly this code. Nothing is
downloaded unless the caller passes a hub id and the machine can reach the hub.
Non-goal: sharding or parallel layouts; the trainer backends apply those after loading.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from miles.models.dsa import stable_topk
from miles.models.vision import VisionProcessor, check_supported, is_vision_language

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
    read_model_config(path)


def read_model_config(path: str) -> dict | None:
    """The parsed config.json of a local checkpoint directory (None for a hub id, read when loaded).

    FileNotFoundError when the directory or its config.json is missing, ValueError when config.json
    is not a JSON object naming its `model_type` (an empty `{}` loads nowhere: transformers cannot tell
    which architecture to build).
    """
    p = Path(path)
    looks_local = p.exists() or path.startswith((".", "/", "~")) or os.sep in path and not _is_hub_id(path)
    if not looks_local:
        return None
    if not p.is_dir():
        raise FileNotFoundError(
            f"model directory {path!r} does not exist: build one with "
            f"`miles init-model --preset tiny-qwen3 --out {path}` or point to a checkpoint directory")
    config = p / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path!r} has no config.json: it is not a Hugging Face checkpoint directory")
    try:
        data = json.loads(config.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config} is not valid UTF-8 JSON ({e}): restore the checkpoint's config.json") from None
    except OSError as e:
        raise ValueError(f"{config} cannot be read ({e.strerror}): fix its permissions") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str) or not data["model_type"]:
        raise ValueError(f"{config} names no model_type (e.g. \"qwen3\"): it is not a Hugging Face model config; "
                         "restore the checkpoint's config.json or build one with `miles init-model`")
    return data


def context_limit(model_config: dict) -> int | None:
    """The model's longest sequence (max_position_embeddings, also inside a multimodal text_config)."""
    for node in (model_config, model_config.get("text_config") or {}):
        n = node.get("max_position_embeddings") if isinstance(node, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def _is_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not Path(path).exists()


def load_model(path: str, dtype: str = "float32", device: str = "cpu"):
    """AutoModelForCausalLM.from_pretrained with eager-friendly defaults for CPU; a vision-language
    checkpoint (models/vision.py) loads whole, vision tower included (AutoModelForImageTextToText).
    A DSA model's indexers keep the earliest keys among equal scores (models/dsa.py)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = read_model_config(path)
    auto = AutoModelForCausalLM
    if is_vision_language(config):
        check_supported(config)
        auto = AutoModelForImageTextToText
    model = auto.from_pretrained(path, dtype=torch_dtype(dtype), attn_implementation=attention_implementation(path, auto))
    stable_topk(model)
    return model.to(device)


def attention_implementation(path: str, auto=None) -> str:
    """"sdpa" (PyTorch's fused attention) where the model's class supports it, else "eager": GPT-OSS
    adds attention sinks to the softmax, which transformers computes only in its eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    auto = auto or AutoModelForCausalLM
    model_class = auto._model_mapping.get(type(AutoConfig.from_pretrained(path)), None)
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", True) else "eager"


def text_config(model_config):
    """The language model's part of an HF config (itself for a text-only model)."""
    return model_config.get_text_config()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    check_model_path(path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_vision(path: str) -> VisionProcessor | None:
    """A vision-language checkpoint's VisionProcessor; None for a text-only model."""
    return VisionProcessor(path) if is_vision_language(read_model_config(path)) else None


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends a generation: the model's generation config's, its config's and the tokenizer's."""
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
