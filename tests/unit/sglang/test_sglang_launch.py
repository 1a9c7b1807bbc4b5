"""What miles hands SGLang: the CPU stand-in for its kernel package (imported by a real python as
`sgl_kernel`, every call refused by name), the launch command derived from rollout.engine, and the
config errors that name their fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from miles.config import ConfigError, load_config
from miles.engine.config import EngineConfig
from miles.run_config import RunConfig
from miles.sglang.config import SGLangConfig
from miles.sglang.server import CPU_STANDIN, launch_command, launch_env


def test_the_stand_in_satisfies_sglangs_imports_and_refuses_every_call():
    code = """
import sgl_kernel
from sgl_kernel import copy_all_layer_kv_cache_cpu
assert sgl_kernel.STANDIN
try:
    import sgl_kernel.scalar_type
except ImportError:
    pass
else:
    raise SystemExit("a submodule imported: SGLang would use it instead of its own fallback")
try:
    copy_all_layer_kv_cache_cpu(1, 2)
except sgl_kernel.KernelUnavailable as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(CPU_STANDIN)}, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "sgl_kernel.copy_all_layer_kv_cache_cpu was called" in out.stdout


def test_the_launch_command_carries_the_engine_settings_and_the_users_flags_last():
    engine = EngineConfig(model_path="/m", device="cpu", dtype="bfloat16", memory_fraction=0.05, max_batch_size=16,
                          seed=7, admin_token="t", context_length=512, host="127.0.0.1")
    cmd = launch_command("/py", engine, 3000, extra=["--mem-fraction-static", "0.1"])
    line = " ".join(cmd)
    for part in ("--model-path /m", "--port 3000", "--dtype bfloat16", "--max-running-requests 16",
                 "--random-seed 7", "--admin-api-key t", "--context-length 512",
                 "--device cpu", "--attention-backend torch_native"):
        assert part in line, part
    assert cmd[-2:] == ["--mem-fraction-static", "0.1"]  # argparse: the last one wins
    on_gpu = launch_command("/py", EngineConfig(model_path="/m", device="cuda"), 3000, routed_experts=True)
    assert "--enable-return-routed-experts" in on_gpu and "--device" not in on_gpu
    # SGLang 0.5.23 does not start on the CPU with routed experts (tests/e2e/test_sglang_live_r3.py shows it):
    # refused before a server is started, naming the engine that records them there.
    with pytest.raises(ConfigError, match="rollout.engine.kind = 'builtin'"):
        launch_command("/py", engine, 3000, routed_experts=True)
    env = launch_env(engine)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["PYTHONPATH"].split(":")[0] == str(CPU_STANDIN)
    gpu = launch_env(EngineConfig(model_path="/m", device="cuda"))
    assert "SGLANG_USE_CPU_ENGINE" not in gpu and str(CPU_STANDIN) not in gpu.get("PYTHONPATH", "")


def test_sglang_settings_are_checked_with_errors_naming_the_fix(tiny_model_dir, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="miles sets for every server"):
        load_config(RunConfig, None, {"model.path": tiny_model_dir, "rollout.engine.kind": "sglang",
                                      "rollout.engine.sglang.args": "--port 1234"})
    with pytest.raises(ConfigError, match="choose one of builtin, sglang"):
        load_config(RunConfig, None, {"model.path": tiny_model_dir, "rollout.engine.kind": "vllm"})
    with pytest.raises(ConfigError, match="--quantization fp8"):
        load_config(RunConfig, None, {"model.path": tiny_model_dir, "rollout.engine.kind": "sglang",
                                      "rollout.engine.quantization": "fp8"})
    monkeypatch.setenv("MILES_SGLANG_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="install-sglang.sh"):
        SGLangConfig().resolve_python()
    assert SGLangConfig(python=sys.executable).resolve_python() == sys.executable
