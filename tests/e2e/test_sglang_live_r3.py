"""R3 against a live SGLang server (sglang==0.5.23 on the CPU) on the tiny Qwen3 MoE model: SGLang cannot
record routed experts there. With `--enable-return-routed-experts` its capturer pins a host buffer with
cudaHostRegister at start-up and the server exits, which is why miles refuses
rollout.return_routed_experts for SGLang engines on the CPU (miles/sglang/server.py, naming the built-in
engine, which records them). This test fails when a pinned SGLang starts with the flag on the CPU: the
refusal should then go, and the routing SGLang records be compared with transformers'.
"""

from __future__ import annotations

import pytest

from miles.engine.config import EngineConfig
from miles.sglang.config import SGLangConfig
from miles.sglang.server import SGLangServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a server start of its own (an MoE checkpoint)


def test_live_sglang_on_the_cpu_does_not_start_with_routed_experts(tiny_moe_model_dir):
    try:
        SGLangConfig().resolve_python()
    except Exception as exc:  # noqa: BLE001 - said in the failure
        pytest.fail(f"no SGLang environment: {exc}")
    engine = EngineConfig(model_path=tiny_moe_model_dir, device="cpu", memory_fraction=0.05)
    # The flag given by hand, past miles' refusal: SGLang exits while allocating the capturer.
    with pytest.raises(RuntimeError, match="did not answer /health") as failed:
        SGLangServer(engine, SGLangConfig(args="--enable-return-routed-experts"))
    assert "_cuda_host_register" in str(failed.value), str(failed.value)[-2000:]
