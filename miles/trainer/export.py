"""A Hugging Face checkpoint directory from the trainer's full weights (`miles train`'s exports).

The trainer gathers full tensors by Hugging Face name (LoRA merged into the base weights); this
writes them with the base checkpoint's config and tokenizer (and a vision-language model's image
processor) so `from_pretrained` and any engine load the directory. It appears whole or not at all (written aside, fsynced, renamed into place).
Non-goal: gathering the weights (the backend's `named_tensors`) or deciding when to export.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from miles.models.loading import load_tokenizer, read_model_config
from miles.models.vision import is_vision_language
from miles.trainer.checkpoint import fsync_file


def write_hf_export(state: dict, model_path: str, out_dir: str) -> None:
    """Write full weights (HF names) as a checkpoint directory `out_dir` with `model_path`'s config and
    tokenizer. The model is built on the meta device: its weights are `state`'s, never initialised."""
    config = AutoConfig.from_pretrained(model_path)
    vision_language = is_vision_language(read_model_config(model_path))
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if vision_language else AutoModelForCausalLM).from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"export mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(model_path).save_pretrained(tmp)
    if vision_language:
        shutil.copy2(Path(model_path) / "preprocessor_config.json", tmp / "preprocessor_config.json")
    for f in tmp.iterdir():
        fsync_file(f)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # a checkpoint directory appears whole or not at all
