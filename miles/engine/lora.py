"""LoRA adapters served by the built-in engine: loaded from PEFT directories, applied in the forward.

An adapter is what PEFT's `save_pretrained` writes: `adapter_config.json` and
`adapter_model.safetensors` (tensors `base_model.model.<module>.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r)). Loading checks it against the served model before anything changes:
every adapted module must be a linear layer of this model that the config's `target_modules` names,
with matching shapes and the config's rank; a refusal names the field and leaves the engine as it was.

Serving: a forward hook on every adapted linear adds `scaling · B(A x)` to its output, row by row of
the batch, so requests on different adapters (or none) decode together. The weights themselves never
change, so `/unload_lora_adapter` gives back the base model's outputs exactly.
Which adapter a request uses: the one its `lora_path` names (SGLang's field, holding an adapter
name); a request that names none uses the default: the most recently loaded adapter still loaded (a
miles extension, `lora_default`), or the base model in SGLang-only mode, as SGLang does. A request
holds on to the adapter it named, so an unload never cuts a running request short.

Non-goals: DoRA, per-module ranks or alphas (`rank_pattern`, `alpha_pattern`), bias or
`modules_to_save` adapters, added tokens, adapters on embeddings; each is refused by name. (rsLoRA's
scaling, alpha/sqrt(r), is honoured.)
"""

from __future__ import annotations

import json
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from safetensors import safe_open

from miles.engine_api.errors import InvalidRequest
from miles.sync.files import UnsafePath, check_regular

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_NAME_CHARS = 256
_PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
# Config switches PEFT writes that change what the adapter computes; accepted only at these values.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none",
                "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
                "trainable_token_indices": None, "target_parameters": None, "layer_replication": None,
                "use_qalora": False, "alora_invocation_tokens": None}


@dataclass(frozen=True, eq=False)
class Adapter:
    """One loaded adapter: per module name, its (A (r, in), B (out, r)) in the model's dtype."""

    name: str
    path: str
    rank: int
    scaling: float
    pinned: bool
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: str, model: torch.nn.Module, pinned: bool = False) -> Adapter:
    """The adapter at `path`, checked against `model`; InvalidRequest naming what is wrong."""
    cfg_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise InvalidRequest(f"lora_path: {path!r} is not a directory on the engine's host; send the directory "
                             "PEFT's save_pretrained wrote")
    for f in (cfg_path, weights_path):
        if not os.path.lexists(f):
            raise InvalidRequest(f"lora_path: {path!r} has no {os.path.basename(f)}; send a directory PEFT's "
                                 "save_pretrained wrote (adapter_config.json + adapter_model.safetensors)")
        try:
            check_regular(f)  # a FIFO or a device would block the reading thread
        except UnsafePath as exc:
            raise InvalidRequest(f"lora_path: {exc}") from None
    try:
        with open(cfg_path) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"lora_path: {CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise InvalidRequest(f"lora_path: {CONFIG_FILE} must hold a JSON object")
    rank, scaling, targets = _check_config(cfg)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for t in targets if isinstance(targets, list) else []:
        if not any(n == t or n.endswith("." + t) for n in linears):
            raise InvalidRequest(f"target_modules: {t!r} names no linear layer of the served model; adapters can "
                                 f"target {sorted({n.rsplit('.', 1)[-1] for n in linears})}")
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            keys = list(f.keys())
            # Shapes are checked from the header first, so a hostile file costs no more than its header.
            for key in keys:
                module, which = _module_of(key)
                lin = linears.get(module)
                if lin is None:
                    raise InvalidRequest(f"lora_path: tensor {key!r} adapts {module!r}, which is not a linear layer "
                                         "of the served model; the adapter was trained on another model")
                if not _targeted(module, targets):
                    raise InvalidRequest(f"target_modules: tensor {key!r} adapts {module!r}, which the adapter's "
                                         f"target_modules {targets!r} does not name")
                want = (rank, lin.in_features) if which == "A" else (lin.out_features, rank)
                shape = tuple(f.get_slice(key).get_shape())
                if shape != want:
                    raise InvalidRequest(f"lora_path: tensor {key!r} has shape {list(shape)}, but rank r = {rank} on "
                                         f"{module!r} needs {list(want)}")
            for key in keys:
                module, which = _module_of(key)
                pairs.setdefault(module, {})[which] = f.get_tensor(key).to(device, dtype)
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the client's error, not the engine's
        raise InvalidRequest(f"lora_path: {WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None
    if not pairs:
        raise InvalidRequest(f"lora_path: {WEIGHTS_FILE} holds no lora_A/lora_B tensors")
    half = sorted(m for m, p in pairs.items() if len(p) != 2)
    if half:
        raise InvalidRequest(f"lora_path: {half[0]!r} has only one of lora_A and lora_B; both are needed")
    return Adapter(name=name, path=path, rank=rank, scaling=scaling, pinned=pinned,
                   weights={m: (p["A"], p["B"]) for m, p in pairs.items()})


def _check_config(cfg: dict) -> tuple[int, float, list[str] | str]:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InvalidRequest(f"lora_path: peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if type(rank) is not int or rank < 1:
        raise InvalidRequest(f"lora_path: {CONFIG_FILE} r = {rank!r}; the rank must be an integer >= 1")
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0:
        raise InvalidRequest(f"lora_path: {CONFIG_FILE} lora_alpha = {alpha!r}; it must be a number > 0")
    for key, ok in _UNSUPPORTED.items():
        value = cfg.get(key)
        if value is not None and value != ok and value not in ([], {}):
            raise InvalidRequest(f"lora_path: {CONFIG_FILE} sets {key} = {json.dumps(value)}, which the built-in "
                                 f"engine does not serve; train with {key} = {json.dumps(ok)}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise InvalidRequest(f"target_modules: {targets!r} is not a regular expression ({exc})") from None
    elif not (isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)):
        raise InvalidRequest(f"target_modules: {targets!r}; expected module names (a non-empty list) or a regex")
    use_rslora = cfg.get("use_rslora", False) is True
    return rank, float(alpha) / (math.sqrt(rank) if use_rslora else rank), targets


def _module_of(key: str) -> tuple[str, str]:
    m = _KEY.match(key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key)
    if m is None:
        raise InvalidRequest(f"lora_path: tensor {key!r} is not a lora_A/lora_B weight under PEFT's names")
    return m["module"], m["which"]


def _targeted(module: str, targets: list[str] | str) -> bool:
    # PEFT's rule: a list names module suffixes; a string is a regex over the whole name.
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


class AdapterSet:
    """The adapters an engine holds, and the hooks that apply them. Callers hold the model lock."""

    def __init__(self, model: torch.nn.Module, limit: int, default_latest: bool):
        self.model, self.limit, self.default_latest = model, limit, default_latest
        self._loaded: dict[str, Adapter] = {}  # in load order: the last is the most recent
        self._hooks: list = []
        self._rows: list[tuple[Adapter, torch.Tensor | None]] | None = None  # (adapter, row index or all)

    @property
    def default(self) -> Adapter | None:
        """The adapter of requests that name none (None: the base model)."""
        if not self.default_latest or not self._loaded:
            return None
        return next(reversed(self._loaded.values()))

    def get(self, name: str) -> Adapter:
        adapter = self._loaded.get(name)
        if adapter is None:
            raise InvalidRequest(f"lora_path: no adapter named {name!r} is loaded (loaded: {sorted(self._loaded)}); "
                                 "load it with /load_lora_adapter first")
        return adapter

    def loaded(self) -> dict[str, str]:
        """{name: path}, SGLang's `loaded_adapters`."""
        return {n: a.path for n, a in self._loaded.items()}

    def check_new(self, name: str) -> None:
        if name in self._loaded:
            raise InvalidRequest(f"lora_name: an adapter named {name!r} is already loaded; unload it first or "
                                 "load under another name")
        if len(self._loaded) >= self.limit:
            raise InvalidRequest(f"lora_name: the engine holds at most {self.limit} adapters (max_lora_adapters, "
                                 f"`miles serve --max-lora-adapters N`) and {len(self._loaded)} are loaded; unload "
                                 "one first")

    def add(self, adapter: Adapter) -> None:
        self.check_new(adapter.name)
        self._loaded[adapter.name] = adapter
        self._rehook()

    def remove(self, name: str) -> Adapter:
        adapter = self.get(name)
        del self._loaded[name]
        self._rehook()
        return adapter

    @contextmanager
    def applied(self, per_row: list[Adapter | None]):
        """Apply each row's adapter (None: none) in the forwards run inside this block."""
        used = [a for a in dict.fromkeys(per_row) if a is not None]
        if not used:
            yield
            return
        if len(used) == 1 and all(a is used[0] for a in per_row):
            self._rows = [(used[0], None)]  # the common case: one adapter for the whole batch
        else:
            device = next(self.model.parameters()).device
            self._rows = [(a, torch.tensor([i for i, r in enumerate(per_row) if r is a], device=device))
                          for a in used]
        try:
            yield
        finally:
            self._rows = None

    def _rehook(self) -> None:
        # Hooks only on modules some loaded adapter adapts: a base-only engine pays nothing per forward.
        for h in self._hooks:
            h.remove()
        self._hooks = []
        wanted = {m for a in self._loaded.values() for m in a.weights}
        for name, module in self.model.named_modules():
            if name in wanted:
                self._hooks.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def add_delta(_module, args, out):
            rows = self._rows
            if rows is None:
                return None
            x = args[0]  # (B, S, in)
            for adapter, idx in rows:
                ab = adapter.weights.get(name)
                if ab is None:
                    continue
                a, b = ab
                if idx is None:
                    out = out + (x @ a.T) @ b.T * adapter.scaling  # (B, S, out)
                else:
                    out = out.index_add(0, idx, (x[idx] @ a.T) @ b.T * adapter.scaling)
            return out

        return add_delta
