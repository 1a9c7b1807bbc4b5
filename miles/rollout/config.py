"""What the rollout side is told: engines, sampling, prompts, rewards (RolloutConfig), and the
tables nested in it for multi-turn rollouts: rollout.agent (AgentConfig), rollout.agent.harness
(HarnessConfig) and rollout.agent.sandbox (SandboxConfig). Held-out evaluation (EvalConfig) is
configured in miles/eval/config.py.

The built-in engine's own config is nested as `rollout.engine`, so every engine setting can be set
from a run config; the run fills in what only it knows (model path, admin token, per-engine seed).
This module holds settings and their own checks only: it imports no agent, harness or environment
code, so reading a run config never loads them. What needs that code (the generate function and the
environment named here, built and checked against their contracts) is checked with the whole run,
in miles/run_checks.py.
Non-goals: the router's and the fleet's settings (router/config.py, liveness.py).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from miles.config import ConfigError
from miles.data.prompts import TaskConfig
from miles.registry import RegistryError, load_attr
from miles.rewards.config import RewardConfig
from miles.rewards.contract import load_components
from miles.engine.config import EngineConfig
from miles.engine_api.tool_calls import TOOL_PARSERS
from miles.sglang.config import SGLangConfig

ENGINE_DTYPES = ("float32", "bfloat16", "float16")
ENGINE_KINDS = ("builtin", "sglang")  # the engines a run can start (orchestration/launch.py's ENGINE_SHELLS)
SANDBOX_BACKENDS = ("auto", "root", "rootless")


@dataclass
class SandboxConfig:
    backend: str = "auto"
    """How commands are confined: "root" (namespaces, a throwaway uid and a cgroup; needs root),
    "rootless" (user namespaces and bubblewrap; needs no privilege, but a cgroup it may write), or "auto"
    (root when running as root and it works here, else rootless)."""
    extra_ro_paths: list[str] = field(default_factory=list)
    """Host paths bound read-only into the sandbox beyond /usr and the dynamic linker's /etc files
    (absolute), for tasks whose tools live elsewhere, e.g. ["/opt/tool"]."""
    cpu_time_s: int = 10
    """CPU seconds per command (RLIMIT_CPU); past it the command gets SIGXCPU, then SIGKILL."""
    memory_mb: int = 1024
    """Memory in MiB: each process's address-space limit, and the limit of all the sandbox's processes
    together (a cgroup, where files written to the working directory count too)."""
    disk_mb: int = 64
    """Size of the working directory in MiB (a tmpfs: writes past it fail with 'No space left')."""
    max_file_mb: int = 16
    """Largest file a command may write, in MiB (RLIMIT_FSIZE)."""
    max_processes: int = 64
    """Most processes the command may have at once (RLIMIT_NPROC, counted per sandbox uid on the root backend
    and per user namespace on the rootless one; the sandbox's cgroup also caps them, where it has a pids controller)."""
    wall_timeout_s: float = 20.0
    """Wall-clock seconds per command; then every process of the command is killed."""
    max_output_bytes: int = 8192
    """Output kept per stream; the rest is dropped and the result says truncated."""
    stop_after_output_factor: int = 16
    """Stop a command once it has printed this many times max_output_bytes (it is only wasting time)."""

    def validate(self) -> None:
        if min(self.cpu_time_s, self.memory_mb, self.disk_mb, self.max_file_mb, self.max_processes,
               self.max_output_bytes) < 1:
            raise ConfigError("sandbox limits (cpu_time_s, memory_mb, disk_mb, max_file_mb, max_processes, "
                              "max_output_bytes) must all be >= 1")
        if self.wall_timeout_s <= 0:
            raise ConfigError("sandbox.wall_timeout_s must be > 0")
        if self.stop_after_output_factor < 1:
            raise ConfigError("sandbox.stop_after_output_factor must be >= 1")
        if self.backend not in SANDBOX_BACKENDS:
            raise ConfigError(f"sandbox.backend = {self.backend!r}: write one of "
                              f"{', '.join(map(repr, SANDBOX_BACKENDS))}")
        for p in self.extra_ro_paths:
            if not isinstance(p, str) or not p.startswith("/") or Path(p).resolve() == Path("/"):
                raise ConfigError(f"sandbox.extra_ro_paths: {p!r} is not an absolute path below / "
                                  "(write e.g. \"/opt/tool\")")


@dataclass
class HarnessConfig:
    command: str = ""
    """The program run once per sample, as a command line (split like a shell would, run without one)."""
    function: str = ""
    """Instead of command: module:function called as f(episode: Episode) in the rollout process (may be async)."""
    reward: Literal["program", "run"] = "program"
    """program: the last stdout line (a number or {"reward": x}) or the function's return; run: rollout.reward
    over the session's last assistant reply and the prompt's label."""
    tool_parser: str = "hermes"
    """How the model writes tool calls (hermes = Qwen2.5/Qwen3 <tool_call> JSON, llama3_json, none, or module:Class)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the program."""
    cwd: str = ""
    """Working directory of the program, where a relative path in command is found (default: the directory
    the run was configured in, i.e. where `miles train` started)."""
    max_concurrent: int = 0
    """Programs running at once in the rollout process (training and eval episodes together); the rest
    wait their turn, and their timeout starts when they start. 0 = two per CPU core."""
    on_failure: Literal["score", "drop_group"] = "score"
    """A crashed, timed-out or reward-less episode: score (trained with fallback_score) or drop_group
    (its group goes to buffer.on_failure)."""
    fallback_score: float = 0.0
    """The reward of a failed episode (on_failure = score)."""
    max_failure_rate: float = 0.5
    """Stop the run once more than this share of episodes failed, counted after min_episodes; 1.0 never stops."""
    min_episodes: int = 20
    """Episodes to run before max_failure_rate is checked."""

    def validate(self) -> None:
        if not 0.0 <= self.max_failure_rate <= 1.0 or self.min_episodes < 0 or self.max_concurrent < 0:
            raise ConfigError("rollout.agent.harness.max_failure_rate must be in [0, 1], min_episodes and "
                              "max_concurrent >= 0")
        try:
            TOOL_PARSERS.get(self.tool_parser)
        except RegistryError as e:
            raise ConfigError(f"rollout.agent.harness.tool_parser: {e}") from None

    def check_program(self) -> None:
        """The program is given and loadable (checked when rollout.generate_fn = "harness")."""
        if bool(self.command) == bool(self.function):
            raise ConfigError("rollout.agent.harness: set exactly one of command (a program to run) and function "
                              "(module:function), e.g. command = \"python my_agent.py\"")
        if self.command:
            try:
                argv = shlex.split(self.command)
            except ValueError as e:
                raise ConfigError(f"rollout.agent.harness.command: {e}") from None
            if not argv:
                raise ConfigError("rollout.agent.harness.command is empty")
        if self.function:
            try:
                fn = load_attr(self.function, "harness function")
            except RegistryError as e:
                raise ConfigError(f"rollout.agent.harness.function: {e}") from None
            if not callable(fn):
                raise ConfigError(f"rollout.agent.harness.function {self.function!r} is not callable: give a "
                                  "function taking one Episode")
        if self.cwd and not os.path.isdir(self.cwd):
            raise ConfigError(f"rollout.agent.harness.cwd {self.cwd!r} is not a directory")
        # Fixed now: the rollout process (a Ray actor) may run elsewhere than where the run was started.
        self.cwd = os.path.abspath(self.cwd or os.getcwd())


@dataclass
class AgentConfig:
    environment: str = "tool_calc"
    """Environment by name (tool_calc, terminal) or module:function returning an Environment."""
    max_turns: int = 4
    """Most model turns per episode; an episode still running after them is truncated."""
    max_response_tokens: int = 256
    """Budget for the whole trajectory after the prompt: model and environment tokens together."""
    episode_timeout_s: float = 120.0
    """Give up on an episode after this many seconds; it is marked aborted (buffer retries or drops it)."""
    turn_end_token: str = "<|im_end|>"
    """Token that ends a model turn in the chat template; generation of a turn stops at it."""
    observation_role: str = "tool"
    """Chat role of the environment's replies."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment's factory, every episode (e.g. {max_commands = 6} for terminal)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits of the sandbox, for environments that run commands in one (terminal)."""
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    """Your own agent program, run once per sample against a session (generate_fn = "harness"); max_turns,
    max_response_tokens, episode_timeout_s and turn_end_token above apply to it too."""

    def validate(self) -> None:
        if self.max_turns < 1 or self.max_response_tokens < 1:
            raise ConfigError("rollout.agent.max_turns and rollout.agent.max_response_tokens must be >= 1")
        if self.episode_timeout_s <= 0:
            raise ConfigError("rollout.agent.episode_timeout_s must be > 0")
        # Whether `environment` builds with env_args is checked with the whole run (run_checks.py): that
        # needs the environments themselves, which this module does not import.


@dataclass
class RolloutEngineConfig(EngineConfig):
    """EngineConfig as a section of the run config: `miles train` sets model_path (from model.path),
    admin_token (a fresh one per run) and seed (run.seed plus the engine's slot) itself."""

    model_path: str = ""
    """Set by the run from model.path; leave empty."""
    host: str = ""
    """Interface each engine binds to and advertises; empty: the address of the Ray node it runs on
    (loopback in a local run)."""
    kind: str = "builtin"
    """Which engine the run starts: builtin (miles' own, miles/engine/) or sglang (a live SGLang server
    per engine, launched with rollout.engine.sglang's python and flags; docs/sglang.md). The settings
    above that SGLang has a flag for (dtype, memory_fraction, max_batch_size, context_length, seed,
    num_threads, prefix_cache, host, port) become its flags."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """With kind = "sglang": SGLang's python and the launch_server flags passed through."""

    def validate(self) -> None:
        super().validate()
        if self.dtype not in ENGINE_DTYPES:
            raise ConfigError(f"rollout.engine.dtype must be one of {', '.join(ENGINE_DTYPES)}")
        if self.kind not in ENGINE_KINDS:
            raise ConfigError(f"rollout.engine.kind = {self.kind!r}: choose one of {', '.join(ENGINE_KINDS)}")
        if self.kind == "sglang":
            self.sglang.validate()
            if self.quantization != "none":
                raise ConfigError(f"rollout.engine.quantization = {self.quantization!r} is the built-in engine's: "
                                  "for SGLang pass its own flag, rollout.engine.sglang.args = \"--quantization fp8\"")
            if self.sglang_only:
                raise ConfigError("rollout.engine.sglang_only is a mode of the built-in engine; an SGLang server "
                                  "speaks only SGLang's protocol anyway: remove it")

    def for_run(self, model_path: str, seed: int, admin_token: str | None) -> EngineConfig:
        """The config of one engine the run starts: these settings plus what only the run knows."""
        own = {f.name for f in dataclasses.fields(EngineConfig)}
        mine = {k: v for k, v in dataclasses.asdict(self).items() if k in own}
        return EngineConfig(**{**mine, "model_path": model_path, "seed": seed, "admin_token": admin_token})


@dataclass
class RolloutConfig:
    num_engines: int = 1
    """Engines to start, built-in or SGLang (rollout.engine.kind; ignored when engine_urls is set)."""
    engine_urls: list[str] = field(default_factory=list)
    """Engines already running (SGLang servers or `miles serve`) to generate with and push weights to,
    instead of starting built-in ones. The run neither starts nor stops them. Their admin token
    (SGLang's --api-key), if any, is read from the environment variable MILES_ENGINE_ADMIN_TOKEN so
    that it never lands in the saved run config."""
    pd_disaggregation: bool = False
    """The engines at engine_urls serve prefill and decode on separate workers (SGLang PD
    disaggregation); weight updates must then reach both kinds, which not every transport can do."""
    engine: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)
    """The built-in engines the run starts (rollout.engine.dtype, .max_batch_size, .num_threads, ...);
    bfloat16 engines route some tokens of an MoE model to other experts than a float32 trainer would."""
    prompts_per_step: int = 32
    """Prompts (groups) per training step."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (the group size)."""
    temperature: float = 1.0
    """Sampling temperature for rollouts; the trainer's logprobs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_new_tokens: int = 16
    """Longest response in tokens."""
    return_routed_experts: bool = False
    """Ask the engines for the experts each token was routed to (MoE models) and keep them on the
    samples: the trainer then reports the routing mismatch, and can replay them (trainer.routing_replay)."""
    reward: str = "exact_match"
    """Reward by name (exact_match, math, boxed_format, regex, weighted, text_parity), module:function or
    path/to/file.py:function; the contract is in docs/rewards.md."""
    reward_config: RewardConfig = field(default_factory=RewardConfig)
    """How the reward runs: process pool, per-call timeout, fallback on errors, the error-rate stop,
    and the settings of the regex and weighted rewards."""
    request_timeout_s: float = 300.0
    """Give up on one /generate after this many seconds."""
    batch_requests: bool = True
    """Send a group's samples as one batched /generate (SGLang's list form). Set false when
    engine_urls name a server that takes one prompt per request, such as the Rust sglang-router."""
    merge_requests: bool = True
    """With batch_requests, the batched requests of groups that are ready together (a step's whole batch)
    go out as one POST per engine, so the engine admits them in one prefill (rollout/merge.py)."""
    group_timeout_s: float = 0.0
    """Give up on a whole group after this many seconds (0 = never); buffer.on_failure decides its fate."""
    partial_rollout: bool = False
    """Resume a sample the engine aborted from its generated prefix instead of failing its group."""
    max_resumes: int = 2
    """Most times one sample is resumed after an abort (partial_rollout)."""
    response_lengths: Literal["natural", "long_tail"] = "natural"
    """natural: stop at EOS; long_tail: each sample's length is drawn from a heavy-tailed law up to
    max_new_tokens and EOS is ignored (controlled workloads for benchmarks)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Where prompts come from."""
    generate_fn: str = "single_turn"
    """How a prompt becomes a scored sample: single_turn, agent (multi-turn episodes against
    rollout.agent.environment), harness (your own openai-client program, rollout.agent.harness), or module:function."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn episodes (generate_fn = "agent"): environment, turn/token budgets, episode timeout."""

    def validate(self) -> None:
        if self.num_engines < 1:
            raise ConfigError("rollout.num_engines must be >= 1")
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"rollout.engine_urls: {url!r} is not an http(s) URL; give each engine's base "
                                  "URL, e.g. http://10.0.0.5:30000")
        if self.pd_disaggregation and not self.engine_urls:
            raise ConfigError("rollout.pd_disaggregation: the built-in engine serves prefill and decode in one "
                              "process; point rollout.engine_urls at SGLang PD-disaggregated servers or set "
                              "rollout.pd_disaggregation = false")
        if self.n_samples_per_prompt < 1 or self.prompts_per_step < 1:
            raise ConfigError("rollout.n_samples_per_prompt and rollout.prompts_per_step must be >= 1")
        if self.temperature <= 0:
            raise ConfigError("rollout.temperature must be > 0 for RL sampling (greedy rollouts give no "
                              "variance within a group)")
        if not 0 < self.top_p <= 1:
            raise ConfigError("rollout.top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            # The engines read top_k <= 0 as "off": 0 or -5 would silently sample from the whole vocabulary.
            raise ConfigError(f"rollout.top_k = {self.top_k}: set -1 (off, the whole vocabulary) or a count >= 1")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"rollout.request_timeout_s = {self.request_timeout_s}: set it > 0 (seconds one "
                              "/generate may take, e.g. 300)")
        if self.max_new_tokens < 1:
            raise ConfigError("rollout.max_new_tokens must be >= 1")
        if self.group_timeout_s < 0 or self.max_resumes < 0:
            raise ConfigError("rollout.group_timeout_s and rollout.max_resumes must be >= 0")
        h = self.agent.harness
        if self.generate_fn == "harness":
            h.check_program()
        elif h.command or h.function:
            raise ConfigError(f"rollout.agent.harness is set but rollout.generate_fn = {self.generate_fn!r}: set "
                              "rollout.generate_fn = \"harness\" to run it, or remove the harness settings")
        self.reward_config.validate()
        try:
            load_components(self.reward, self.reward_config)
        except ValueError as e:
            raise ConfigError(f"rollout.reward: {e}") from None
