"""docs/configuration.md is generated from the config dataclasses and must match them."""

import dataclasses
import importlib.util
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_configuration_page_matches_the_config_dataclasses():
    gen = _generator()
    expected = gen.render()
    page = ROOT / "docs" / "configuration.md"
    assert page.is_file(), "docs/configuration.md is missing: run .venv/bin/python docs/gen_config_reference.py"
    assert page.read_text() == expected, (
        "docs/configuration.md is out of date with the config dataclasses: "
        "run .venv/bin/python docs/gen_config_reference.py and commit the result")


def test_every_setting_of_the_run_config_is_documented_with_type_default_and_meaning():
    from miles.run_config import RunConfig

    gen = _generator()
    page = gen.render()

    def leaves(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(hints[f.name]):
                yield from leaves(hints[f.name], key)
            else:
                yield key

    keys = list(leaves(RunConfig))
    assert "rollout.task.name" in keys and "metrics.wandb" in keys
    for key in keys:
        row = next((line for line in page.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"{key} missing from the reference"
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 4 and all(cells), f"{key}: incomplete row {row!r}"


@dataclasses.dataclass
class _Undocumented:
    fine: int = 1
    """Has its docstring."""
    forgotten: str = "x"


def test_a_field_without_a_docstring_is_refused_with_the_fix():
    gen = _generator()
    with pytest.raises(gen.MissingDocstring, match="_Undocumented.forgotten has no docstring"):
        list(gen.sections(_Undocumented, "demo"))
