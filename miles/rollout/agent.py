"""Multi-turn agent rollouts with token-in/token-out (TITO) bookkeeping, and the generate-function
registry that lets a run choose how one prompt becomes one scored Sample.

One episode is one token sequence. The prompt is the chat template applied once to the first
observation; after that the sequence only ever grows by
  - the ids the engine returned for a model turn (loss mask 1, the engine's logprob per token), and
  - the ids of the environment's reply, tokenized on its own as a chat-template suffix (loss mask 0,
    logprob 0.0 as a placeholder the trainer never reads).
The history is never decoded and re-tokenized, so the trainer sees exactly the tokens the engine
sampled even where decode→encode would merge or split them differently. Each model turn records the
weight version it ran under; a per-episode timeout aborts the engine request and marks the sample
ABORTED so the buffer can retry or drop its group.

Non-goals: parallel tool calls within a turn, streaming, environment-side tokenization.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from miles.buffer.types import Sample, SampleStatus
from miles.config import ConfigError
from miles.registry import Registry
from miles.data.chat import ChatFormat
from miles.rollout.environments import build_environment, check_environment
from miles.rollout.environments.sandbox import SandboxConfig
from miles.rollout.generate import GenerationError, generate, routed_experts_of, versions_of
from miles.rollout.harness import HarnessConfig, harness

_SEND_ATTEMPTS = 3


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
        try:
            check_environment(self.environment, self.env_args, self.sandbox)
        except ValueError as e:
            raise ConfigError(f"rollout.agent.environment: {e}") from None


@dataclass
class GenerateContext:
    """What a generate function may use; built by the rollout manager for each request."""

    client: object                     # httpx.AsyncClient
    url: str                           # engine or router base URL
    tokenizer: object
    encode: Callable[..., list[int]]  # a Prompt (or its text) → prompt ids (chat template or plain)
    reward_fn: Callable[[str, str | None], float]
    agent: AgentConfig
    return_routed_experts: bool = False  # ask the engine for routed experts and keep them on the Sample


class GenerateFn(Protocol):
    async def __call__(self, ctx: GenerateContext, prompt, params, rid: str) -> Sample:
        """Turn one data-source Prompt into one Sample with its reward filled in (or, with the
        function's `scores_itself = False`, left to the run's reward runner)."""


async def single_turn(ctx: GenerateContext, prompt, params, rid: str) -> Sample:
    """One /generate call on the encoded prompt; the reward runner scores it (scores_itself = False)."""
    s = await generate(ctx.client, ctx.url, ctx.encode(prompt), params, rid=rid, label=prompt.label,
                       prompt_index=prompt.index, return_routed_experts=ctx.return_routed_experts)
    s.metadata = dict(prompt.metadata)
    return s


single_turn.scores_itself = False  # type: ignore[attr-defined]


async def multi_turn(ctx: GenerateContext, prompt, params, rid: str) -> Sample:
    """An episode against a fresh environment; the reward is the environment's."""
    env = build_environment(ctx.agent.environment, ctx.agent.env_args, ctx.agent.sandbox)
    return await run_episode(ctx.client, ctx.url, ctx.tokenizer, env, prompt, params, ctx.agent, rid,
                             return_routed_experts=ctx.return_routed_experts)


GENERATE_FNS: Registry[GenerateFn] = Registry(
    "generate function", arity=4, coroutine=True,
    hint=" (an `async def` taking (ctx, prompt, params, rid) and returning a Sample)")
GENERATE_FNS.register("single_turn", single_turn)
GENERATE_FNS.register("agent", multi_turn)
GENERATE_FNS.register("harness", harness)


def get_generate_fn(spec: str) -> GenerateFn:
    """The generate function `spec` names (registry name or `module:function`); RegistryError names the fix."""
    return GENERATE_FNS.get(spec)


async def run_episode(client, url: str, tokenizer, env, prompt, params, cfg: AgentConfig, rid: str,
                      fmt: ChatFormat | None = None, return_routed_experts: bool = False) -> Sample:
    """Play one episode of `env` on `prompt` against the engine at `url`; always closes `env`."""
    fmt = fmt or ChatFormat(tokenizer, cfg.turn_end_token, cfg.observation_role)
    traj = _Trajectory(want_routed=return_routed_experts)
    try:
        first = await asyncio.to_thread(env.reset, prompt)
        traj.prompt_ids = fmt.prompt_ids(first)
        try:
            await asyncio.wait_for(_play(client, url, env, params, cfg, rid, fmt, traj), cfg.episode_timeout_s)
        except asyncio.TimeoutError:
            traj.status = SampleStatus.ABORTED
            traj.note = f"episode timed out after {cfg.episode_timeout_s:g}s"
            await _abort(client, url, traj.current_rid)
    finally:
        await asyncio.to_thread(env.close)
    return Sample(prompt_ids=traj.prompt_ids, response_ids=traj.ids, rollout_logprobs=traj.logprobs,
                  loss_mask=traj.mask, reward=traj.reward, status=traj.status, weight_versions=traj.versions,
                  response_text=traj.last_action, label=prompt.label, prompt_index=prompt.index,
                  routed_experts=traj.routed, metadata=dict(prompt.metadata))


@dataclass
class _Trajectory:
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)           # everything after the prompt, model and environment
    logprobs: list[float] = field(default_factory=list)    # one per id; 0.0 on environment tokens
    mask: list[int] = field(default_factory=list)          # 1 on model tokens, 0 on environment tokens
    versions: list[int] = field(default_factory=list)      # weight version of each model turn
    reward: float = 0.0
    status: SampleStatus = SampleStatus.COMPLETED
    last_action: str = ""
    current_rid: str | None = None
    note: str = ""
    want_routed: bool = False
    routed: str | None = None  # the latest turn's routed experts: its prompt was the whole history so far

    def append(self, ids: list[int], logprobs: list[float] | None, trained: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [int(trained)] * len(ids)


async def _play(client, url, env, params, cfg: AgentConfig, rid: str, fmt: ChatFormat, traj: _Trajectory) -> None:
    for turn in range(cfg.max_turns):
        budget = cfg.max_response_tokens - len(traj.ids)
        if budget <= 0:
            traj.status = SampleStatus.TRUNCATED
            return
        traj.current_rid = f"{rid}-t{turn}"
        out = await _generate_turn(client, url, traj.prompt_ids + traj.ids, params, min(params.max_new_tokens, budget),
                                   fmt.end_id, traj.current_rid, turn, traj.want_routed)
        meta = out["meta_info"]
        ids = list(out["output_ids"])
        logprobs = [float(lp) for lp, *_ in meta.get("output_token_logprobs", [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"{url} returned {len(ids)} tokens but {len(logprobs)} logprobs")
        traj.routed = routed_experts_of(meta, url, traj.want_routed)
        traj.append(ids, logprobs, trained=True)
        traj.versions.append(min(versions_of(meta)))
        finish = meta["finish_reason"]["type"]
        if finish == "abort":
            traj.status = SampleStatus.ABORTED
            return
        closed = bool(ids) and ids[-1] == fmt.end_id
        action = fmt.action_text(ids[:-1] if closed else ids)
        traj.last_action = action
        step = await asyncio.to_thread(env.step, action)
        traj.reward += float(step.reward)
        if step.done:
            return
        obs = fmt.observation_ids(step.observation, closed)
        if len(traj.ids) + len(obs) >= cfg.max_response_tokens:
            traj.status = SampleStatus.TRUNCATED  # no room left for another model turn
            return
        traj.append(obs, None, trained=False)
    traj.status = SampleStatus.TRUNCATED


async def _generate_turn(client, url, input_ids, params, max_new_tokens, end_id, rid, turn,
                         return_routed_experts: bool = False) -> dict:
    import httpx  # not at the top: AgentConfig is part of the run config, which loads without httpx

    sp = params.to_json()
    sp["max_new_tokens"] = max_new_tokens
    sp["stop_token_ids"] = [end_id]
    if params.seed is not None:
        sp["sampling_seed"] = (params.seed + 7919 * turn) & 0x7FFFFFFF
    body = {"input_ids": input_ids, "sampling_params": sp, "return_logprob": True, "rid": rid}
    if return_routed_experts:
        body["return_routed_experts"] = True
    for attempt in range(_SEND_ATTEMPTS):
        try:
            resp = await client.post(f"{url}/generate", json=body)
            break
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
            # A pooled keep-alive connection the server closed just as we reused it (common under load).
            # Only what comes back is recorded, so resending (under a fresh rid) cannot corrupt the episode.
            if attempt == _SEND_ATTEMPTS - 1:
                raise
            body["rid"] = f"{rid}-resend{attempt + 1}"
    if resp.status_code != 200:
        raise GenerationError(f"{url}/generate answered {resp.status_code}: {resp.text[:300]}")
    return resp.json()


async def _abort(client, url, rid) -> None:
    if rid is None:
        return
    try:
        await client.post(f"{url}/abort_request", json={"rid": rid}, timeout=5)
    except Exception:  # noqa: BLE001 - the episode is already given up; a dead engine is reported elsewhere
        pass
