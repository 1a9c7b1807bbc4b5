"""Variant sections: a table whose valid keys depend on a choice made inside it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from miles.config import ConfigError
from miles.config.loader import build, load_config, parse_overrides


@dataclass
class Shape:
    kind: str = "circle"
    """Which shape."""

    @classmethod
    def variant(cls, data: dict) -> type:
        kinds = {"circle": Circle, "square": Square}
        kind = data.get("kind", "circle")
        if kind not in kinds:
            raise ValueError(f"unknown shape {kind!r}: choose one of {sorted(kinds)}")
        return kinds[kind]


@dataclass
class Circle(Shape):
    radius: float = 1.0
    """Radius."""


@dataclass
class Square(Shape):
    side: float = 2.0
    """Side."""


@dataclass
class Root:
    shape: Shape = field(default_factory=Shape)
    """The shape."""


def test_the_choice_decides_the_keys_and_the_class():
    cfg = build(Root, {"shape": {"kind": "square", "side": 3.0}})
    assert isinstance(cfg.shape, Square) and cfg.shape.side == 3.0
    with pytest.raises(ConfigError, match=r"unknown key 'shape.radius'.*valid keys there: kind, side"):
        build(Root, {"shape": {"kind": "square", "radius": 3.0}})
    with pytest.raises(ConfigError, match=r"shape: unknown shape 'hexagon'"):
        build(Root, {"shape": {"kind": "hexagon"}})


def test_an_absent_section_gets_the_default_variant():
    assert isinstance(build(Root, {}).shape, Circle)


def test_overrides_follow_the_choice_made_before_them():
    cfg = load_config(Root, overrides=parse_overrides(["--shape.kind", "square", "--shape.side", "5"]))
    assert isinstance(cfg.shape, Square) and cfg.shape.side == 5.0
    with pytest.raises(ConfigError, match="unknown key 'shape.side'"):
        load_config(Root, overrides=parse_overrides(["--shape.side", "5"]))
