"""Turn TOML tables and `--section.key value` overrides into typed, nested dataclasses.

Every leaf is checked against its field's annotation; an unknown key or a value of the wrong type
fails at load time with the dotted key and what to write instead.

A section whose keys depend on a choice made inside it (the algorithm's own knobs, a transport's own
settings) is a *variant section*: its dataclass defines a classmethod `variant(data) -> type` that
returns the dataclass to build for that table (a subclass, usually the chosen entry's `Config`), so
`trainer.algorithm.gamma` is a key only when the chosen algorithm has it. Non-goal: schema inheritance
or includes; a run is one TOML file plus overrides.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the fix."""


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _unwrap_optional(tp) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


# What an int or float setting is called in errors, and the TOML values it takes (an integer is a
# fine float; a bool, though an int to Python, is neither).
_NUMBERS = {int: ("an integer", (int,)), float: ("a number", (int, float))}


def coerce(value: Any, tp, key: str, from_cli: bool = False) -> Any:
    """Check (and for CLI strings, parse) one value against a field annotation."""
    inner, optional = _unwrap_optional(tp)
    if value is None or (from_cli and optional and value in ("none", "None", "null")):
        if optional:
            return None
        raise ConfigError(f"{key}: may not be empty; give a {_type_name(inner)}")
    tp = inner
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of settings, got {value!r}")
        return build(tp, value, key)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if from_cli and isinstance(value, str) and any(isinstance(c, bool) for c in choices):
            value = {"true": True, "false": False}.get(value.lower(), value)
        # By type as well as value: 1 and 0 equal True and False but are neither.
        if not any(type(value) is type(c) and value == c for c in choices):
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if from_cli and isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        items = [coerce(v, item_tp, f"{key}[{i}]", from_cli) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is Any:
        return value
    if tp is bool:
        if from_cli and isinstance(value, str):
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp in _NUMBERS:
        what, accepted = _NUMBERS[tp]
        if from_cli and isinstance(value, str):
            try:
                value = tp(value)
            except ValueError:
                raise ConfigError(f"{key}: expected {what}, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise ConfigError(f"{key}: expected {what}, got {value!r}")
        if tp is float and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported setting type {tp!r}")


def section_class(cls, data: dict[str, Any], key: str = "") -> type:
    """The dataclass a table is built as: `cls`, or the variant `cls.variant(data)` chooses."""
    variant = getattr(cls, "variant", None)
    if variant is None:
        return cls
    try:
        chosen = variant(data)
    except ValueError as e:  # an unknown or unloadable name, said by the registry
        raise ConfigError(f"{key or 'config'}: {e}") from None
    if not (isinstance(chosen, type) and issubclass(chosen, cls)):
        raise ConfigError(f"{key or 'config'}: the chosen variant's config {chosen!r} must be a dataclass "
                          f"subclassing {cls.__name__}")
    return chosen


def build(cls, data: dict[str, Any], prefix: str = "") -> Any:
    cls = section_class(cls, data, prefix)
    fields = _field_types(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"[{prefix}]" if prefix else "the top level"
        raise ConfigError(f"unknown key {_join(prefix, unknown[0])!r} in {where}; "
                          f"valid keys there: {', '.join(sorted(fields))}")
    kwargs = {name: coerce(value, fields[name], _join(prefix, name)) for name, value in data.items()}
    for name, tp in fields.items():
        # An absent variant section is still built through its hook, so the default choice gets its own config.
        inner, _ = _unwrap_optional(tp)
        if name not in kwargs and dataclasses.is_dataclass(inner) and hasattr(inner, "variant"):
            kwargs[name] = build(inner, {}, _join(prefix, name))
    return cls(**kwargs)


def validate_tree(obj) -> None:
    """Run every section's `validate()` (defaults included), innermost first."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            validate_tree(value)
    check = getattr(obj, "validate", None)
    if callable(check):
        check()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def parse_overrides(argv: list[str]) -> dict[str, str]:
    """`--a.b 3 --c=x` → {"a.b": "3", "c": "x"}; values stay strings until typed against the schema."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"unexpected argument {tok!r}: overrides look like --section.key value")
        key = tok[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"override --{key} has no value: write --{key} VALUE")
            i += 1
            value = argv[i]
        out[key.replace("-", "_")] = value
        i += 1
    return out


def _apply_override(cls, data: dict[str, Any], dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node, node_cls = data, cls
    for depth, part in enumerate(parts):
        # Overrides are applied in order, so `--trainer.algorithm.name ppo` before `--...gamma` works.
        fields = _field_types(section_class(node_cls, node, ".".join(parts[:depth])))
        path = ".".join(parts[: depth + 1])
        if part not in fields:
            raise ConfigError(f"unknown key {path!r}; valid keys there: {', '.join(sorted(fields))}")
        tp, _ = _unwrap_optional(fields[part])
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"{path!r} is a section; override one of its keys, e.g. --{path}.KEY VALUE")
            node[part] = coerce(raw, fields[part], path, from_cli=True)
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"{'.'.join(parts[:depth + 1])!r} is not a section")
        node = node.setdefault(part, {})
        node_cls = tp


def _read_config_file(p: Path) -> dict[str, Any]:
    """The table a TOML file (or a run's saved config.json, for resume) holds."""
    kind = "JSON" if p.suffix == ".json" else "TOML"
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a folder: give the path of a .toml file")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        # TOML is UTF-8 by definition; a file saved as Latin-1 or UTF-16 is the usual cause.
        raise ConfigError(f"{p}: not UTF-8 (byte {e.start} is {e.object[e.start:e.start + 1]!r}): save the file "
                          f"as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read ({e.strerror}): check its permissions") from None
    try:
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: not valid {kind}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: holds {type(data).__name__}, not a table of settings")
    return data


def load_config(cls, path: str | Path | None = None, overrides: dict[str, str] | None = None,
                validate: bool = True):
    """Load TOML (optional), apply dotted overrides, build and validate `cls`. `validate=False` builds
    it typed but unchecked, for readers of a config meant for another machine (`miles simulate`)."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_config_file(Path(path))
    for key, raw in (overrides or {}).items():
        _apply_override(cls, data, key, raw)
    cfg = build(cls, data)
    if validate:
        validate_tree(cfg)
    return cfg


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")
