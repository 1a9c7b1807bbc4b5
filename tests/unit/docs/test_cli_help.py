"""`miles --help` and every subcommand's help answer at once: heavy imports stay lazy; and every list
of choices in help is the registry it names (a preset, an algorithm, a transport registered anywhere
shows up in help).

The deterministic check is that no heavy library loads for help. The time bound is loose and
scaled by how long a bare `import miles.cli` takes right now, so a busy machine does not fail it.
"""

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from miles.registry import Registry

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "transformers", "ray", "matplotlib", "wandb", "tensorboard", "safetensors")
# Subcommands that hand their options to a module of their own (see miles/cli.py).
DELEGATES = {"router": "miles.rollout.router", "report": "miles.metrics.report", "serve": "miles.engine.server",
             "sessions": "miles.rollout.sessions.server"}
HELP = """
import json, sys
from miles.cli import main
try:
    main({argv!r})
except SystemExit as e:
    code = e.code or 0
else:
    code = 0
print(json.dumps({{"heavy": sorted(m for m in {heavy!r} if m in sys.modules), "code": code}}))
"""


def _subcommands() -> list[str]:
    from miles.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return list(sub.choices)


def _timed(code: str) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    return time.perf_counter() - t0, out


@pytest.fixture(scope="module")
def budget() -> float:
    baseline = min(_timed("import miles.cli")[0] for _ in range(2))
    return max(3.0, 30 * baseline)


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in _subcommands()],
                         ids=lambda a: " ".join(a))
def test_help_is_quick_and_loads_no_heavy_library(argv, budget):
    module = DELEGATES.get(argv[0])
    if module and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not part of this tree yet")
    elapsed, out = _timed(HELP.format(argv=argv, heavy=HEAVY))
    assert out.returncode == 0, out.stderr[-800:]
    *text, last = out.stdout.strip().splitlines()
    result = json.loads(last)
    assert result["code"] == 0, out.stdout + out.stderr
    assert "usage" in ("\n".join(text) + out.stderr).lower()
    assert result["heavy"] == [], f"miles {' '.join(argv)} imports {result['heavy']}: keep them inside the command"
    assert elapsed < budget, f"miles {' '.join(argv)} took {elapsed:.1f}s (budget {budget:.1f}s)"


def test_top_level_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "miles.cli", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for name in _subcommands():
        assert name in out.stdout


# -- lists of choices: printed from the registry each names --------------------------------------------
def _help(*argv: str) -> str:
    """`miles ARGV --help` as a user sees it, on a terminal wide enough that no option's help wraps."""
    out = subprocess.run([sys.executable, "-m", "miles.cli", *argv, "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "1000"})
    assert out.returncode == 0, out.stderr[-800:]
    return out.stdout


def test_init_model_help_names_every_preset():
    from miles.models.presets import PRESETS

    assert {"tiny-qwen-vl", "qwen3-0.6b-shape"} <= set(PRESETS)  # the two the hand-written help left out
    assert f" model preset: {', '.join(sorted(PRESETS))}\n" in _help("init-model")


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
def test_every_setting_chosen_by_name_is_listed_from_its_registry(command):
    from miles.cli import NAMED_SETTINGS

    text = _help(command)
    for key, registry in NAMED_SETTINGS.items():
        assert f"  {key}: {', '.join(registry.names())}\n" in text, key


def _registries_in_source() -> dict[str, Registry]:
    """Every module-level `NAME = Registry(...)` under miles/, by `module.NAME`."""
    found = {}
    for path in sorted((ROOT / "miles").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Registry":
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                found[f"{module}.{target.id}"] = getattr(importlib.import_module(module), target.id)
    return found


def _field_type(cls, dotted: str):
    """The annotation at a dotted key of a config dataclass (`sets[]` steps into a list's items)."""
    tp = cls
    for part in dotted.split("."):
        hints = typing.get_type_hints(tp)
        assert part.removesuffix("[]") in hints, f"{dotted}: {tp.__name__} has no field {part!r}"
        tp = hints[part.removesuffix("[]")]
        if part.endswith("[]"):
            (tp,) = typing.get_args(tp)
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)  # X | None -> X
    return tp


def test_every_registry_is_listed_under_a_setting_of_the_run_config():
    from miles.cli import NAMED_SETTINGS
    from miles.run_config import RunConfig

    listed = {id(r) for r in NAMED_SETTINGS.values()}
    unlisted = [name for name, r in _registries_in_source().items() if id(r) not in listed]
    assert not unlisted, f"{unlisted}: name the setting that chooses from each in miles.cli.NAMED_SETTINGS"
    for key in NAMED_SETTINGS:
        assert _field_type(RunConfig, key) is str, key


def test_bench_simulate_and_sessions_help_list_what_they_choose_from():
    from miles.capacity.fleet import DEVICES
    from miles.capacity.shapes import PRESETS as SHAPES
    from miles.cli import benchmarks
    from miles.engine_api.tool_calls import TOOL_PARSERS

    assert "rollout" in benchmarks() and "_answer_first" not in benchmarks()
    assert f"benchmark: {', '.join(benchmarks())}\n" in _help("bench")
    simulate = _help("simulate")
    assert f"{', '.join(DEVICES)}, or cpu (needs a calibration)\n" in simulate
    assert f"a preset: {', '.join(sorted(SHAPES))}\n" in simulate
    assert f"how the model writes tool calls: {', '.join(TOOL_PARSERS.names())}, or module:Class\n" in _help("sessions")
