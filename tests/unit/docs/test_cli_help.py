"""`miles --help` and every subcommand's help answer at once: heavy imports stay lazy."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MILES = [sys.executable, "-m", "miles.cli"]
# Subcommands that hand their options to a module of their own (see miles/cli.py).
DELEGATES = {"router": "miles.rollout.router", "report": "miles.metrics.report", "serve": "miles.rollout.engine.server"}


def _subcommands() -> list[str]:
    from miles.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return list(sub.choices)


def _help(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    out = subprocess.run(MILES + args, capture_output=True, text=True, timeout=60, cwd=ROOT)
    return time.perf_counter() - t0, out


def test_top_level_help_lists_every_subcommand_quickly():
    elapsed, out = _help(["--help"])
    assert out.returncode == 0, out.stderr
    for name in _subcommands():
        assert name in out.stdout
    assert elapsed < 3.0, f"miles --help took {elapsed:.1f}s: something heavy is imported at the top level"


@pytest.mark.parametrize("name", _subcommands())
def test_subcommand_help_is_quick(name):
    module = DELEGATES.get(name)
    if module and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not part of this tree yet")
    elapsed, out = _help([name, "--help"])
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"miles {name} --help failed: {text[-800:]}"
    assert "usage" in text.lower(), text
    assert elapsed < 3.0, f"miles {name} --help took {elapsed:.1f}s: keep heavy imports inside the command"


def test_report_help_loads_no_heavy_library():
    # torch, ray and matplotlib are what would make help slow; none of them may load for it.
    code = ("import sys; from miles.cli import main\n"
            "try:\n    main(['report', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'ray', 'matplotlib', 'transformers', 'wandb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
