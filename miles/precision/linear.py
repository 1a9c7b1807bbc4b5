"""Linear layers that compute with their weight as a low-precision format stores it.

`quantize_linears(model, name, mode)` swaps a model's `nn.Linear` layers for `QuantizedLinear`s that
share the same Parameter objects (names, state dicts, optimizers and FSDP see nothing new), and makes
the stacked expert weights of MoE blocks (3-D parameters, one (out, in) matrix per expert, as
Qwen3-MoE's `mlp.experts` holds them) go through the same format, one matrix per expert:

- `mode="train"` (QAT): every forward uses `fake_quantize(weight)`: the value the format stores, with
  a straight-through gradient into the float32 master weight. The trained policy is the quantized one.
- `mode="serve"` (an engine): the layer keeps the weight in the format (a `QuantizedTensor`, made
  again whenever the weight changes) and dequantizes it in each matmul. It still holds the full
  weight it received, because weight updates, noise fills and checksums work on that tensor.

Both modes run `dequantize(quantize(w))` on the same weight, so a trainer and an engine holding the same
float32 weights compute the same logits. By default the embeddings, the LM head and MoE routers stay in
full precision (as DeepSeek-V3's FP8 recipe and NVFP4/MXFP8 checkpoints leave them), as do activations.
With `embeddings=True` the input embedding and the LM head go through the format too (a
`QuantizedEmbedding` looks its rows up in the format's value): opt-in, for when their bytes matter more
than the accuracy they may cost; a tied embedding and LM head share one stored copy.

Non-goals: low-precision matmul kernels (this is emulation: the numerics, none of the speed), and
quantizing norms, biases or routers.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from miles.models.routers import router_modules
from miles.precision.formats import Format, QuantizedTensor, dequantize, fake_quantize, get_format, quantize

Mode = Literal["train", "serve"]

# Linear layers left in full precision: the output head (its logits are what RL measures; unless
# embeddings are asked for) and, by identity, MoE routers (a flipped top-k choice costs far more than
# the bytes saved).
_KEEP = ("lm_head",)


class StoredWeight:
    """A weight's value in a format, made again only when the weight's memory or contents changed."""

    def __init__(self, fmt: Format):
        self.fmt = fmt
        self._stored: tuple[tuple[int, int], list[QuantizedTensor]] | None = None

    def value(self, weight: torch.Tensor, per_matrix: bool) -> torch.Tensor:
        """The dequantized weight, in its dtype; `per_matrix`: quantize each w[i] of a 3-D weight alone."""
        w = weight.detach()
        try:
            key = (w.data_ptr(), w._version)  # a copy_ into it bumps _version; a swapped .data moves data_ptr
        except RuntimeError:  # an inference tensor keeps no version counter: a cached copy could be stale
            key = None
        if key is None or self._stored is None or self._stored[0] != key:
            stored = [quantize(m, self.fmt) for m in w] if per_matrix else [quantize(w, self.fmt)]
            self._stored = None if key is None else (key, stored)
        else:
            stored = self._stored[1]
        values = [dequantize(q) for q in stored]
        return (torch.stack(values) if per_matrix else values[0]).to(weight.dtype)

    def install(self, weight: torch.Tensor, stored: list[QuantizedTensor]) -> None:
        """Use `stored` (bytes received quantized, see wire.py) as the value of `weight` as it is now,
        instead of quantizing it again."""
        w = weight.detach()
        self._stored = ((w.data_ptr(), w._version), list(stored))

    def drop(self) -> None:
        self._stored = None


class InFormat:
    """What a layer computing with its 2-D `weight` in a format shares: the format's value of the weight."""

    weight: torch.nn.Parameter
    fmt: Format
    mode: Mode
    _stored: StoredWeight

    def effective_weight(self) -> torch.Tensor:
        """The weight the layer computes with: the format's value of the current weight, in its dtype."""
        if self.mode == "train":
            return fake_quantize(self.weight, self.fmt)
        return self._stored.value(self.weight, per_matrix=False)

    def drop_stored(self) -> None:
        """Free the quantized copy (the weights were released); the next forward makes it again."""
        self._stored.drop()


class QuantizedLinear(InFormat, torch.nn.Linear):
    """nn.Linear whose matmul uses its weight as stored in `fmt`."""

    def __init__(self, linear: torch.nn.Linear, fmt: Format, mode: Mode, stored: StoredWeight | None = None):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: nothing is copied
        self.fmt, self.mode = fmt, mode
        self._stored = stored or StoredWeight(fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.effective_weight(), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", format={self.fmt.name}, mode={self.mode}"


class QuantizedEmbedding(InFormat, torch.nn.Embedding):
    """nn.Embedding whose lookups return rows of its weight as stored in `fmt` (blocks run along a row)."""

    def __init__(self, emb: torch.nn.Embedding, fmt: Format, mode: Mode, stored: StoredWeight | None = None):
        torch.nn.Module.__init__(self)
        for k in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                  "sparse"):
            setattr(self, k, getattr(emb, k))
        self.weight = emb.weight  # the same Parameter, tied or not
        self.fmt, self.mode = fmt, mode
        self._stored = stored or StoredWeight(fmt)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.effective_weight(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", format={self.fmt.name}, mode={self.mode}"


class QuantizedExperts:
    """Wraps an MoE experts module's forward so that its 3-D weights are seen as the format stores them,
    one expert matrix at a time. The module keeps its class, Parameters and names."""

    def __init__(self, module: torch.nn.Module, fmt: Format, mode: Mode):
        self.module, self.fmt, self.mode = module, fmt, mode
        self.names = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
        self._stored = {n: StoredWeight(fmt) for n in self.names}
        self._forward = module.forward
        module.forward = self.forward
        module.quantized_experts = self  # found again by drop_stored

    def weight(self, name: str) -> torch.Tensor:
        p = self.module._parameters[name]
        if self.mode == "train":
            return torch.stack([fake_quantize(m, self.fmt) for m in p])  # straight through to each expert
        return self._stored[name].value(p, per_matrix=True)

    def forward(self, *args, **kwargs):
        # For the length of the forward, the weights' names point at their quantized values (plain
        # tensors); the Parameters go back in place before anyone else (FSDP, the optimizer) sees them.
        params = {n: self.module._parameters[n] for n in self.names}
        values = {n: self.weight(n) for n in self.names}
        try:
            for n in self.names:
                del self.module._parameters[n]
                setattr(self.module, n, values[n])
            return self._forward(*args, **kwargs)
        finally:
            for n in self.names:
                delattr(self.module, n)
                self.module._parameters[n] = params[n]

    def drop_stored(self) -> None:
        for s in self._stored.values():
            s.drop()


def _embedding_layers(model: torch.nn.Module, key: str) -> set[int]:
    """ids of `model`'s input embedding and LM head (HF's get_input/output_embeddings)."""
    layers = [getattr(model, f, lambda: None)() for f in ("get_input_embeddings", "get_output_embeddings")]
    if layers[0] is None:
        raise ValueError(f"{key}: quantizing embeddings needs a model with get_input_embeddings() "
                         f"({type(model).__name__} has none); turn the embeddings option off")
    return {id(m) for m in layers if m is not None}


def quantize_linears(model: torch.nn.Module, name: str, mode: Mode, key: str = "quantization",
                     embeddings: bool = False) -> list[str]:
    """Swap every Linear of `model` but the LM head and MoE routers for a QuantizedLinear in format
    `name`, and put MoE experts' weights through it too ("none" leaves the model alone). `embeddings`:
    the input embedding and the LM head as well. Returns the names of the layers and experts modules
    now quantized."""
    if name == "none":
        return []
    fmt = get_format(name, key)
    keep = {id(r) for r in router_modules(model)} if hasattr(model, "config") else set()  # HF models only
    heads = _embedding_layers(model, key) if embeddings else set()
    stores: dict[int, StoredWeight] = {}  # by Parameter: a tied embedding and LM head share one stored copy

    def stored(weight: torch.nn.Parameter) -> StoredWeight:
        return stores.setdefault(id(weight), StoredWeight(fmt))

    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is torch.nn.Embedding and id(child) in heads:
                setattr(parent, child_name, QuantizedEmbedding(child, fmt, mode, stored(child.weight)))
            elif (type(child) is not torch.nn.Linear or id(child) in keep
                  or (child_name in _KEEP and id(child) not in heads)):
                continue
            else:
                setattr(parent, child_name, QuantizedLinear(child, fmt, mode, stored(child.weight)))
            swapped.append(full)
    for module_name, module in model.named_modules():
        if module_name.endswith("experts") and any(p.dim() == 3 for p in module.parameters(recurse=False)):
            QuantizedExperts(module, fmt, mode)
            swapped.append(module_name)
    if not swapped:
        raise ValueError(f"{key} = {name!r}: {type(model).__name__} has no Linear layer to quantize")
    return swapped


def served_weights(model: torch.nn.Module) -> dict[str, tuple[Format, bool]]:
    """name -> (format, per_matrix) of every weight `model` computes with in a format (per_matrix: a
    3-D expert weight, quantized one matrix at a time)."""
    return {name: (store.fmt, per_matrix) for name, (store, _, per_matrix) in _stores(model).items()}


def install(model: torch.nn.Module, stored: dict[str, list[QuantizedTensor]]) -> None:
    """Make each named weight use the given stored matrices as its quantized copy (see wire.py)."""
    stores = _stores(model)
    for name, matrices in stored.items():
        store, weight, _ = stores[name]
        store.install(weight(), matrices)


def _stores(model: torch.nn.Module) -> dict:
    """name -> (StoredWeight, the weight's getter, per_matrix) of every quantized weight of `model`."""
    out = {}
    for module_name, m in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(m, InFormat):
            out[prefix + "weight"] = (m._stored, lambda m=m: m.weight, False)
        elif hasattr(m, "quantized_experts"):
            qe = m.quantized_experts
            for n in qe.names:
                out[prefix + n] = (qe._stored[n], lambda qe=qe, n=n: qe.module._parameters[n], True)
    return out


def drop_stored(model: torch.nn.Module) -> None:
    """Free every QuantizedLinear's quantized copy of its weight (an engine releasing its memory)."""
    for m in model.modules():
        if isinstance(m, InFormat):
            m.drop_stored()
        elif hasattr(m, "quantized_experts"):
            m.quantized_experts.drop_stored()
