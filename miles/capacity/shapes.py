"""Model shapes: the figures a capacity projection needs (parameters, active parameters, layers,
experts, hidden size, the dtype weights travel in), with presets for the models the published
weight-sync figures were measured on.

Non-goal: a parameter count derived from every tensor. The presets take the totals their makers
publish; `scaled()` builds a shape for any size (`--model-size 744B`) from one of them.

Sources of the preset figures (public model cards and configs):
  * GLM-5 (zai-org/GLM-5): 744B total, 40B active, 78 layers, hidden 6144, 64 attention heads,
    256 routed experts with 8 active per token (model card, as listed on docs.vultr.com/models/
    z.ai-glm-5; radixark/miles docs/advanced/p2p-weight-transfer.md: "GLM-5 744B(40B)"). Vocabulary:
    GLM-4.5's 151,552 (Megatron-Bridge GLM 4.5 page), an assumption that only matters under fp8.
  * Kimi-K2 (moonshotai/Kimi-K2-Instruct): 1.04T total, 32B active, 61 layers, hidden 7168,
    384 experts with 8 active, vocabulary 163,840; the released checkpoint stores its weights in FP8
    with 128x128 block scales (model card; ktransformers doc/en/Kimi-K2.md). Its engines are updated in
    FP8: the trainer dequantizes to BF16 to train and requantizes for each update (radixark/miles
    docs/advanced/p2p-weight-transfer.md).
  * Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B): 235B total, 22B active, 94 layers, hidden 4096,
    128 experts with 8 active, vocabulary 151,936 (model card / config.json).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from miles.config.loader import ConfigError

WIRE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0}
"""Bytes per parameter of each weight dtype on the wire and in engine memory."""

FP8_BLOCK_SCALE_BYTES = 4.0 / (128 * 128)
"""Per-parameter overhead of FP8 block quantization: one fp32 scale per 128x128 block (DeepSeek-V3's
and Kimi-K2's checkpoint format)."""


@dataclass(frozen=True)
class ModelShape:
    """A model as the capacity model sees it."""

    name: str
    """Preset name, or the size it was scaled to."""
    params: float
    """Total parameters."""
    active_params: float
    """Parameters each token passes through (all of them for a dense model)."""
    layers: int
    """Decoder layers."""
    hidden_size: int
    """Width of the residual stream (activations are layers x hidden per token)."""
    experts: int = 0
    """Routed experts per MoE layer (0 = dense)."""
    experts_per_token: int = 0
    """Routed experts each token goes to."""
    vocab_size: int = 151936
    """Vocabulary (the embedding and LM head, which stay in bf16 when the rest is quantized)."""
    tied_embeddings: bool = False
    """Input embedding and LM head share one tensor."""
    engine_dtype: str = "bf16"
    """The dtype the engines hold and weight updates carry (bf16, or fp8 block-quantized)."""

    @property
    def embedding_params(self) -> float:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def bytes_in(self, dtype: str) -> float:
        """Bytes of all weights stored in `dtype` (the embeddings stay bf16 under fp8)."""
        if dtype == "fp8":
            quantized = self.params - self.embedding_params
            return quantized * (1.0 + FP8_BLOCK_SCALE_BYTES) + self.embedding_params * WIRE_BYTES["bf16"]
        return self.params * WIRE_BYTES[dtype]

    @property
    def checkpoint_bytes_bf16(self) -> float:
        """A BF16 checkpoint: two bytes per parameter."""
        return self.bytes_in("bf16")

    @property
    def wire_bytes(self) -> float:
        """Bytes of one full weight update (one engine copy) in the engines' dtype."""
        return self.bytes_in(self.engine_dtype)


PRESETS: dict[str, ModelShape] = {
    "glm-5-744b": ModelShape("glm-5-744b", params=744e9, active_params=40e9, layers=78, hidden_size=6144,
                             experts=256, experts_per_token=8, vocab_size=151552),
    "kimi-k2-1t": ModelShape("kimi-k2-1t", params=1.04e12, active_params=32e9, layers=61, hidden_size=7168,
                             experts=384, experts_per_token=8, vocab_size=163840, engine_dtype="fp8"),
    "qwen3-235b-a22b": ModelShape("qwen3-235b-a22b", params=235e9, active_params=22e9, layers=94, hidden_size=4096,
                                  experts=128, experts_per_token=8, vocab_size=151936),
}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMBT])\s*$", re.IGNORECASE)
_UNITS = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_size(text: str) -> float:
    """'744B' → 7.44e11, '1T' → 1e12, '0.6b' → 6e8."""
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"--model-size {text!r} is not a size: write a number and a unit, e.g. 744B, 1T or 600M")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def model_shape(name_or_size: str) -> ModelShape:
    """A preset by name, or the closest preset scaled to a size ('744B' is GLM-5's shape; '70B' is the
    smallest preset, Qwen3-235B-A22B, scaled down with the same active fraction and layer count)."""
    key = name_or_size.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    try:
        params = parse_size(name_or_size)
    except ConfigError:
        raise ConfigError(f"--model-size {name_or_size!r}: give a size (e.g. 744B, 1T) or a preset "
                          f"({', '.join(PRESETS)})") from None
    for shape in PRESETS.values():
        if abs(shape.params - params) / shape.params < 0.02:
            return shape
    base = min(PRESETS.values(), key=lambda s: abs(s.params - params))
    return scaled(base, params)


def scaled(base: ModelShape, params: float) -> ModelShape:
    """`base`'s shape at another size: the same active fraction, layers and experts."""
    return dataclasses.replace(base, name=f"{base.name}@{params / 1e9:g}B", params=params,
                               active_params=base.active_params * params / base.params)
