"""How miles launches SGLang servers: which python runs them and which flags they get beyond the ones
miles derives from `rollout.engine` (the `rollout.engine.sglang` table).

Non-goal: SGLang's own settings, which stay SGLang's flags (passed through as `args`).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from miles.config import ConfigError

PYTHON_ENV = "MILES_SGLANG_PYTHON"  # a user's own SGLang environment, when rollout.engine.sglang.python is empty
VENV_ENV = "MILES_SGLANG_VENV"  # where scripts/install-sglang.sh put it, when not the default
DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".sglang-venv"  # scripts/install-sglang.sh's default
SUPPORTED_VERSION = "0.5.23"  # the release whose protocol miles speaks (docs/sglang.md)


@dataclass
class SGLangConfig:
    python: str = ""
    """The python of an environment with sglang installed; empty: $MILES_SGLANG_PYTHON, else the venv
    scripts/install-sglang.sh makes ($MILES_SGLANG_VENV, default .sglang-venv in the miles checkout)."""
    args: str = ""
    """More `sglang.launch_server` flags, written as on a command line and passed through as written,
    after the ones miles derives (so they win), e.g. "--chunked-prefill-size 512 --schedule-policy lpm"."""
    startup_timeout_s: float = 300.0
    """How long one server may take to answer /health (loading a model, allocating its KV pool)."""

    def validate(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ConfigError(f"rollout.engine.sglang.startup_timeout_s = {self.startup_timeout_s}: set it > 0")
        try:
            flags = shlex.split(self.args)
        except ValueError as e:
            raise ConfigError(f"rollout.engine.sglang.args: {e}") from None
        for owned in ("--model-path", "--model", "--port", "--host", "--admin-api-key", "--api-key"):
            if any(f == owned or f.startswith(owned + "=") for f in flags):
                raise ConfigError(f"rollout.engine.sglang.args sets {owned}, which miles sets for every server it "
                                  "launches (from model.path, rollout.engine.host and the run's admin token): remove it")

    def flags(self) -> list[str]:
        return shlex.split(self.args)

    def resolve_python(self) -> str:
        """The python that runs the servers; raises naming the fix when there is none."""
        venv = Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)
        python = self.python or os.environ.get(PYTHON_ENV) or str(venv / "bin" / "python")
        if not os.access(python, os.X_OK):
            raise ConfigError(
                f"rollout.engine.kind = 'sglang' needs a python with sglang=={SUPPORTED_VERSION}, and {python} is not "
                "one: run ./scripts/install-sglang.sh (it makes .sglang-venv), or point rollout.engine.sglang.python "
                f"(or ${PYTHON_ENV}) at the python of your own SGLang environment")
        return python
