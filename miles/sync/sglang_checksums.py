"""The checksums a live SGLang server on the CPU reports for its weights (/weights_checker action
"checksum"), computed on the trainer's side from the tensors it sent: a push to SGLang is then
verified against the trainer's own tensors, not only engine against engine.

SGLang 0.5.23 (sglang/srt/utils/weight_checker.py) hashes every parameter and buffer of its model
(`_hash_tensor`): on the CPU, the first 8 bytes of SHA-256 over the tensor's bytes, as 16 hex digits
(sglang/srt/managers/mm_utils.py, `tensor_hash`); on a GPU a Triton kernel the trainer cannot run, so
there engines are compared with one another (verify.compare_across_engines). Its models hold some HF
tensors fused into one parameter (SGLang's stacked params): q/k/v in `qkv_proj`, gate/up in
`gate_up_proj`, concatenated along dim 0 in that order (tensor-parallel size 1: one rank holds all).
Non-goals: tensor-parallel shards, quantized serving (SGLang hashes the dequantized weight).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from miles.sync.verify import VerificationError, _names, _table

if TYPE_CHECKING:
    import torch

# SGLang's fused parameter -> the HF projections it holds, in the order they are stacked.
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART = {part: (fused, i, len(parts)) for fused, parts in STACKED.items() for i, part in enumerate(parts)}


def sglang_cpu_hash(*tensors: "torch.Tensor") -> str:
    """SGLang's CPU checksum of the tensors concatenated in order (their bytes, one after another)."""
    import torch

    h = hashlib.sha256()
    for t in tensors:
        h.update(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return f"{int.from_bytes(h.digest()[:8], 'big'):016x}"


def engine_name(name: str) -> tuple[str, int, int] | None:
    """(SGLang's fused name, this part's index, parts) for an HF tensor SGLang stacks, else None."""
    module, _, leaf = name.rpartition(".")
    prefix, _, proj = module.rpartition(".")
    if proj not in _PART:
        return None
    fused, i, n = _PART[proj]
    return f"{prefix}.{fused}.{leaf}", i, n


class SGLangChecksums:
    """What each engine tensor's SGLang CPU checksum must be after a push, filled in bucket by bucket
    (sync/prepare.py's push_weights calls `add`). `dtype`: the engines' parameter dtype, which the
    sent tensors are cast to before hashing (an upcast on receive is exact)."""

    def __init__(self, dtype: "torch.dtype | None" = None):
        self.dtype = dtype
        self.expected: dict[str, str] = {}
        self._parts: dict[str, list] = {}  # fused name -> its parts seen so far (a layer's worth at most)

    def add(self, bucket) -> None:
        for name, t in bucket:
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            fused = engine_name(name)
            if fused is None:
                self.expected[name] = sglang_cpu_hash(t)
                continue
            key, i, n = fused
            parts = self._parts.setdefault(key, [None] * n)
            parts[i] = t
            if all(p is not None for p in parts):
                self.expected[key] = sglang_cpu_hash(*parts)
                del self._parts[key]

    def compare(self, client, urls: list[str]) -> int:
        """Every engine's checksums must equal the trainer's for every tensor the trainer sent and the
        engine holds; returns how many tensors were compared per engine. Raises VerificationError naming
        the engine and the tensors that differ, or that the engine holds and no push wrote."""
        if self._parts:
            raise VerificationError(f"the push sent only part of the fused tensors {_names(sorted(self._parts))}")
        problems, compared = [], 0
        for url, reply in zip(urls, client.post_all(urls, "/weights_checker", {"action": "checksum"})):
            held = _table(reply)
            differ = sorted(n for n in held if n in self.expected and held[n] != self.expected[n])
            unwritten = sorted(n for n in held if n not in self.expected)
            compared = len(held) - len(unwritten)
            if differ:
                problems.append(f"engine {url} differs from the trainer in {len(differ)} tensor(s): {_names(differ)}")
            if unwritten:
                problems.append(f"engine {url} holds {len(unwritten)} tensor(s) the push did not write: "
                                f"{_names(unwritten)}")
        if problems:
            raise VerificationError("after the push, SGLang's weights are not the trainer's: " + " | ".join(problems))
        return compared


def applies(server_infos: list[dict]) -> bool:
    """Whether every engine is a live SGLang server on the CPU (its /get_server_info names SGLang's
    release as `version`, which the built-in engine's does not, and its device), whose checksums the
    trainer can recompute."""
    return bool(server_infos) and all(i.get("version") and i.get("device") == "cpu" for i in server_infos)


def engine_dtype(server_infos: list[dict]) -> "torch.dtype | None":
    """The engines' parameter dtype (SGLang's --dtype), when they agree on a concrete one."""
    import torch

    names = {i.get("dtype") for i in server_infos}
    name = names.pop() if len(names) == 1 else None
    return getattr(torch, name, None) if isinstance(name, str) and name != "auto" else None
