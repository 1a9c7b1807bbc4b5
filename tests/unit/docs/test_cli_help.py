"""`miles --help` and every subcommand's help answer at once: heavy imports stay lazy.

The deterministic check is that no heavy library loads for help. The time bound is loose and
scaled by how long a bare `import miles.cli` takes right now, so a busy machine does not fail it.
"""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
