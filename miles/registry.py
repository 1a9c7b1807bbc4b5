"""Named registries: a variant is chosen by its registry name or given as `module:attr`.

Every pluggable kind (algorithms, transports, rewards, group filters, generate functions,
environments, schedules, ...) is one `Registry[T]` next to the Protocol its entries satisfy. An entry
may be registered as the object itself or as a `"module:attr"` string, imported on first use (so
naming a heavy variant does not import it). User extensions are given as `module:attr` in a run
config; every entry, built-in or not, goes through the same check when it is looked up:

- `protocol`: a class entry must define the Protocol's methods; a callable entry is left alone;
- `arity`: a function must take exactly that many required positional arguments;
- `coroutine`: a function must be `async def`.

Errors are `RegistryError` (a ValueError) and name the fix. Non-goal: instantiation (the caller
builds the object with its own config).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class RegistryError(ValueError):
    """An unknown name, an unloadable `module:attr`, or an entry that does not fit its Protocol."""


def load_attr(spec: str, kind: str) -> Any:
    """The attribute `module:attr` points at (`attr` may be dotted); RegistryError otherwise."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise RegistryError(f"{kind} {spec!r} is not of the form module:attr")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise RegistryError(f"{kind} {spec!r} cannot be loaded ({e}); check that the module is importable "
                            "and defines that name") from None
    return obj


def protocol_methods(protocol: type) -> list[str]:
    """The public methods a Protocol declares (its own and its Protocol bases'), in order."""
    names: list[str] = []
    for klass in reversed(protocol.__mro__):
        if klass is object or not getattr(klass, "_is_protocol", False):
            continue
        names += [n for n, v in vars(klass).items() if not n.startswith("_") and callable(v) and n not in names]
    return names


def required_positional(fn: Callable) -> int:
    """How many positional arguments `fn` requires (self excluded for bound methods)."""
    params = inspect.signature(fn).parameters.values()
    return sum(1 for p in params
               if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


class Registry(Generic[T]):
    """Entries of one kind by name; `get` also accepts `module:attr` for user entries."""

    def __init__(self, kind: str, *, protocol: type | None = None, arity: int | None = None,
                 coroutine: bool = False, hint: str = ""):
        self.kind = kind
        self.protocol = protocol
        self.arity = arity
        self.coroutine = coroutine
        self.hint = hint
        self._entries: dict[str, T | str] = {}

    def register(self, name: str, entry: T | str | None = None):
        """Add `entry` (an object or a lazy `module:attr` string) under `name`; usable as a decorator."""
        if entry is None:
            def deco(obj: T) -> T:
                self._entries[name] = obj
                return obj
            return deco
        self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, spec: str) -> T:
        """The entry registered as `spec`, or the `module:attr` it names; checked against the contract."""
        if spec in self._entries:
            entry = self._entries[spec]
            if isinstance(entry, str):
                entry = self._entries[spec] = load_attr(entry, self.kind)
        elif ":" in spec:
            entry = load_attr(spec, self.kind)
        else:
            raise RegistryError(f"unknown {self.kind} {spec!r}: choose one of {self.names()} or give "
                                f"module:attr{self.hint}")
        self.check(spec, entry)
        return entry  # type: ignore[return-value]

    def check(self, spec: str, entry: Any) -> None:
        """Raise RegistryError when `entry` does not fit this registry's contract."""
        if inspect.isclass(entry):
            if self.protocol is not None:
                missing = [m for m in protocol_methods(self.protocol) if not callable(getattr(entry, m, None))]
                if missing:
                    raise RegistryError(f"{self.kind} {spec!r} ({entry.__name__}) lacks {missing}: it must "
                                        f"implement the {self.protocol.__name__} protocol{self.hint}")
            return
        if not callable(entry):
            raise RegistryError(f"{self.kind} {spec!r} is not callable{self.hint}")
        if self.coroutine and not inspect.iscoroutinefunction(entry):
            raise RegistryError(f"{self.kind} {spec!r} must be an `async def`{self.hint}")
        if self.arity is not None:
            try:
                n = required_positional(entry)
            except (TypeError, ValueError):
                return  # builtins without a signature: nothing to check
            if n != self.arity:
                raise RegistryError(f"{self.kind} {spec!r} must take {self.arity} required positional "
                                    f"arguments; it takes {n}{self.hint}")

