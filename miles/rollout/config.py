"""What the rollout side is told: engines, sampling, prompts, rewards (RolloutConfig). Held-out
evaluation (EvalConfig) is configured in miles/eval/config.py and re-exported here.

The built-in engine's own config is nested as `rollout.engine`, so every engine setting can be set
from a run config; the run fills in what only it knows (model path, admin token, per-engine seed).
Non-goals: the router's and the fleet's settings (router/config.py, liveness.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from miles.config import ConfigError
from miles.rollout.agent import AgentConfig, get_generate_fn
from miles.data.prompts import TaskConfig
from miles.rewards.config import RewardConfig
from miles.rewards.contract import load_components
from miles.rollout.engine.config import EngineConfig

ENGINE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class RolloutEngineConfig(EngineConfig):
    """EngineConfig as a section of the run config: `miles train` sets model_path (from model.path),
    admin_token (a fresh one per run) and seed (run.seed plus the engine's slot) itself."""

    model_path: str = ""
    """Set by the run from model.path; leave empty."""
    host: str = ""
    """Interface each engine binds to and advertises; empty: the address of the Ray node it runs on
    (loopback in a local run)."""

    def validate(self) -> None:
        super().validate()
        if self.dtype not in ENGINE_DTYPES:
            raise ConfigError(f"rollout.engine.dtype must be one of {', '.join(ENGINE_DTYPES)}")

    def for_run(self, model_path: str, seed: int, admin_token: str | None) -> EngineConfig:
        """The config of one engine the run starts: these settings plus what only the run knows."""
        return EngineConfig(**{**dataclasses.asdict(self), "model_path": model_path, "seed": seed,
                               "admin_token": admin_token})


@dataclass
class RolloutConfig:
    num_engines: int = 1
    """Built-in engine processes to start (ignored when engine_urls is set)."""
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
        try:
            get_generate_fn(self.generate_fn)
        except ValueError as e:
            raise ConfigError(f"rollout.generate_fn: {e}") from None
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
