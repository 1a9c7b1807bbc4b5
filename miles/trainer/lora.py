"""LoRA adapters via PEFT: only the adapters train; the base weights stay frozen.

Weight sync sends either the merged weights (base + B·A·alpha/r under the base HF names, which
any engine loads; `merged_tensors`) or the adapter alone, written as PEFT's `save_pretrained` writes
it (`save_adapter`: adapter_config.json + adapter_model.safetensors) for engines that load adapters
(miles/sync/adapter.py). Which one travelled is reported in the sync metrics.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Literal

from miles.config.loader import ConfigError

_PREFIX = "base_model.model."


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank r (0 = off: full fine-tuning)."""
    alpha: float = 16.0
    """LoRA scaling numerator: the update is B·A·alpha/r."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated names of the linear layers that get adapters."""
    sync: Literal["merged", "adapter"] = "merged"
    """Weight sync sends merged full weights (any engine, any transport), or "adapter": the adapter alone,
    written in PEFT's format and loaded by every engine through /load_lora_adapter (built-in engines)."""
    adapter_dir: str = ""
    """With sync = "adapter": where each version's adapter is written, a directory every engine host
    reads; empty: a fresh directory under the system temp directory (engines on the trainer's host)."""

    def validate(self) -> None:
        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError("trainer.lora.rank >= 0, trainer.lora.alpha > 0 and 0 <= trainer.lora.dropout < 1")
        if self.sync not in ("merged", "adapter"):
            raise ConfigError("trainer.lora.sync must be 'merged' or 'adapter'")
        if self.adapter_dir and self.sync != "adapter":
            raise ConfigError("trainer.lora.adapter_dir is where lora.sync = 'adapter' writes adapters: set "
                              "trainer.lora.sync = 'adapter', or leave adapter_dir empty")
        if self.rank and not self.targets:
            raise ConfigError("trainer.lora.target_modules is empty: name the linear layers, e.g. \"q_proj,v_proj\"")

    @property
    def targets(self) -> list[str]:
        return [t.strip() for t in self.target_modules.split(",") if t.strip()]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def peft_config(cfg: LoraConfig, base_model: str | None = None):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=cfg.targets,
                          bias="none", base_model_name_or_path=base_model)


def apply_lora(model, cfg: LoraConfig):
    from peft import get_peft_model

    return get_peft_model(model, peft_config(cfg))


def _hf_name(name: str) -> str:
    return name[len(_PREFIX):] if name.startswith(_PREFIX) else name


def merged_tensors(named, cfg: LoraConfig):
    """(HF name, W + B·A·scaling) for adapted linears, other tensors unchanged. PEFT's state dict
    lists a layer's base weight, then lora_A, then lora_B, so one layer is buffered at a time.
    Tensors may be None (ranks that receive nothing); the yield sequence is the same on all ranks."""
    pending: dict[str, object] = {}
    for name, t in named:
        if ".lora_A." in name or ".lora_B." in name:
            stem = name.split(".lora_")[0]
            pending[stem + (".A" if ".lora_A." in name else ".B")] = t
            if stem + ".A" in pending and stem + ".B" in pending and stem + ".W" in pending:
                w, a, b = pending.pop(stem + ".W"), pending.pop(stem + ".A"), pending.pop(stem + ".B")
                merged = None if w is None else w + (b @ a) * cfg.scaling
                yield _hf_name(stem) + ".weight", merged
            continue
        if ".base_layer." in name:
            stem = name.split(".base_layer.")[0]
            if name.endswith(".weight"):
                pending[stem + ".W"] = t
                continue
            yield _hf_name(name.replace(".base_layer.", ".")), t
            continue
        yield _hf_name(name), t
    if pending:
        raise RuntimeError(f"LoRA merge left unmatched tensors: {sorted(pending)[:4]}")


def adapter_tensors(named):
    """Only the adapter tensors, under PEFT's names (base weights are never resent)."""
    for name, t in named:
        if ".lora_A." in name or ".lora_B." in name:
            yield name, t


def save_adapter(named, cfg: LoraConfig, out_dir: str, base_model: str | None = None) -> int:
    """Write the adapter tensors `named` (as `adapter_tensors` yields them) to `out_dir` as PEFT's
    save_pretrained does: adapter_config.json, and adapter_model.safetensors under PEFT's saved names
    (the adapter's own name, "default", taken out). The directory appears whole or not at all.
    Returns the bytes of tensors written."""
    from safetensors.torch import save_file

    tensors = {}
    for name, t in named:
        saved = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        tensors[saved] = t.detach().contiguous().clone()
    if not tensors:
        raise RuntimeError("save_adapter: no lora_A/lora_B tensors to write (is trainer.lora.rank > 0?)")
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config(cfg, base_model).save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)
    return sum(t.numel() * t.element_size() for t in tensors.values())
