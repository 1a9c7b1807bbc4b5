"""One live SGLang server, launched and stopped by miles: `SGLangServer(engine_config, sglang_config)`.

The command line is derived from the engine's settings (the same `rollout.engine` fields a built-in
engine reads: model, host, dtype, memory fraction, batch size, context length, seed, threads) and the
run's admin token (SGLang's --admin-api-key: the weight, pause and checker routes need it, /generate
does not), then `rollout.engine.sglang.args` as written. On the CPU it adds the flags SGLang needs
there (torch_native attention, no CUDA graphs, no warm-up) and puts miles' stand-in for the kernel
package on the server's PYTHONPATH (cpu_standin/sgl_kernel).

The server runs as the leader of a process group of its own (launcher/sglang_child.py), so `stop()`
ends SGLang's scheduler and detokenizer processes with it, and a killed owner takes the group along.
Non-goals: restarts and health (the fleet's), weight updates (sync/).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from miles.config import ConfigError
from miles.devices import cpu_threads
from miles.engine.config import EngineConfig
from miles.net import LOOPBACK, PARENT_PID_ENV, free_port
from miles.sglang.config import SGLangConfig

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "launcher" / "sglang_child.py"
CPU_STANDIN = HERE / "cpu_standin"  # holds sgl_kernel/, the stand-in (CPU only)
# SGLang on the CPU: attention in PyTorch (no flashinfer), no CUDA graphs, and no warm-up request
# (which would only cost start-up time: a health probe generates a token anyway).
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup"]


def launch_command(python: str, engine: EngineConfig, port: int, routed_experts: bool = False,
                   extra: list[str] | None = None) -> list[str]:
    """`python launcher ARGS` for one server of `engine` at `port` (`extra`: rollout.engine.sglang.args)."""
    if engine.quantization != "none":
        raise ConfigError(f"rollout.engine.quantization = {engine.quantization!r} is the built-in engine's: for SGLang "
                          "pass its own flag, rollout.engine.sglang.args = \"--quantization fp8\"")
    cmd = [python, str(LAUNCHER), "--model-path", engine.model_path, "--host", engine.host or LOOPBACK,
           "--port", str(port), "--dtype", engine.dtype, "--mem-fraction-static", str(engine.memory_fraction),
           "--max-running-requests", str(engine.max_batch_size), "--random-seed", str(engine.seed)]
    if engine.admin_token:
        cmd += ["--admin-api-key", engine.admin_token]
    if engine.context_length:
        cmd += ["--context-length", str(engine.context_length)]
    if not engine.prefix_cache:
        cmd += ["--disable-radix-cache"]
    cpu = on_cpu(engine)
    if routed_experts and cpu:
        # SGLang 0.5.23 pins the capturer's host buffer with cudaHostRegister at start-up
        # (sglang/srt/mem_cache/pool_host/common.py, _cuda_host_register): no CPU server starts with the flag.
        raise ConfigError("rollout.return_routed_experts with rollout.engine.kind = 'sglang' needs SGLang on a GPU: "
                          "SGLang 0.5.23 records routed experts in CUDA-registered host memory and does not start "
                          "on the CPU with --enable-return-routed-experts; on the CPU use the built-in engine "
                          "(rollout.engine.kind = 'builtin'), which records them too")
    if routed_experts:
        cmd += ["--enable-return-routed-experts"]
    if cpu:
        cmd += CPU_FLAGS
    return cmd + list(extra or [])


def on_cpu(engine: EngineConfig) -> bool:
    if engine.device != "auto":
        return engine.device == "cpu"
    import torch  # only where the device is left to the machine

    return not torch.cuda.is_available()


def launch_env(engine: EngineConfig) -> dict[str, str]:
    """The server's environment: this one, plus who started it (launcher/), its threads, and on the CPU
    SGLang's CPU engine with the kernel stand-in first on its path."""
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), "OMP_NUM_THREADS": str(cpu_threads(engine.num_threads))}
    if on_cpu(engine):
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_STANDIN), os.environ.get("PYTHONPATH", "")) if p)
    return env


class SGLangServer:
    """A running SGLang server at `.url` (its main process: `.pid`); `.stop()` ends its process group."""

    def __init__(self, engine: EngineConfig, cfg: SGLangConfig, routed_experts: bool = False):
        host = engine.host or LOOPBACK
        port = engine.port or free_port(host)
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.cmd = launch_command(cfg.resolve_python(), engine, port, routed_experts, cfg.flags())
        self.output: collections.deque[str] = collections.deque(maxlen=200)  # its last lines, for errors
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=launch_env(engine), start_new_session=True)
        self.pid = self.proc.pid
        threading.Thread(target=self._drain, name="miles-sglang-output", daemon=True).start()
        self._wait_healthy(cfg.startup_timeout_s, engine.admin_token)

    def _drain(self) -> None:
        for line in self.proc.stdout:  # always read: a full pipe would block the server
            self.output.append(line)

    def _wait_healthy(self, timeout_s: float, token: str | None) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        code = self.proc.poll()
        self.stop()
        raise RuntimeError(f"SGLang server at {self.url} did not answer /health within {timeout_s:g}s "
                           f"(exit code {code}; rollout.engine.sglang.startup_timeout_s); command: "
                           f"{' '.join(self._shown())}\nits last output:\n{''.join(list(self.output)[-40:])}")

    def _shown(self) -> list[str]:
        """The command with the admin token hidden."""
        return ["***" if i and self.cmd[i - 1] == "--admin-api-key" else a for i, a in enumerate(self.cmd)]

    def signal(self, sig: int) -> None:
        """Signal the server's main process (fault injection: what a crash of the server looks like)."""
        os.kill(self.pid, sig)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever is left of it."""
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.pid):
                return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
