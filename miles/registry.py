"""Named registries: a variant is chosen by its registry name or given as `module:function`.

Each registry (rewards, group filters, generate functions, environments, ...) keeps its own dict and
its own Protocol check; this module only resolves a name to an object, with errors that name the fix.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping


def resolve(spec: str, registry: Mapping[str, Any], kind: str, hint: str = "") -> Any:
    """`registry[spec]`, or the attribute a `module:function` spec points at. ValueError otherwise."""
    if spec in registry:
        return registry[spec]
    if ":" not in spec:
        raise ValueError(f"unknown {kind} {spec!r}: choose one of {sorted(registry)} or give module:function{hint}")
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{kind} {spec!r} cannot be loaded ({e}); check that the module is importable "
                         "and defines that name") from None
