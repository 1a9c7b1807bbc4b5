"""Multi-turn agent rollouts with token-in/token-out (TITO) bookkeeping: the episode loop behind the
generate function `agent` (rollout.generate_fn = "agent").

One episode is one token sequence. The prompt is the chat template applied once to the first
observation; after that the sequence only ever grows by
  - the ids the engine returned for a model turn (loss mask 1, the engine's logprob per token), and
  - the ids of the environment's reply, tokenized on its own as a chat-template suffix (loss mask 0,
    logprob 0.0 as a placeholder the trainer never reads).
The history is never decoded and re-tokenized, so the trainer sees exactly the tokens the engine
sampled even where decode→encode would merge or split them differently.

Images (a vision-language model): the first observation shows the prompt's images, or those of the
environment's `Observation`, and any environment reply may bring more. Each image's placeholder is
expanded to its image tokens where its observation is tokenized, so the sequence holds them as the
processor lays them out; every request sends the images of the sequence so far as `image_data`, in
order (with one placeholder per image in `input_ids`, SGLang's wire form), and the Sample records
them all, in the order of their tokens. An image token the model samples itself is text to the
engine, but sent back it would read as an image placeholder: such an episode ends after that turn
(TRUNCATED) unless the environment ends it there. Each model turn records the
weight version it ran under; a per-episode timeout aborts the engine request and marks the sample
ABORTED so the buffer can retry or drop its group.

Non-goals: parallel tool calls within a turn, streaming, environment-side tokenization.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import httpx

from miles.buffer.types import PromptImage, Sample, SampleStatus
from miles.data.chat import ChatFormat
from miles.data.errors import DataError
from miles.data.images import row_images
from miles.rollout.config import AgentConfig
from miles.rollout.environments import build_environment
from miles.rollout.environments.contract import Observation
from miles.rollout.generate import GenerateContext, GenerationError, routed_experts_of, versions_of, wire_ids

_SEND_ATTEMPTS = 3


async def multi_turn(ctx: GenerateContext, prompt, params, rid: str) -> Sample:
    """An episode against a fresh environment; the reward is the environment's (the generate function
    `agent`)."""
    env = build_environment(ctx.agent.environment, ctx.agent.env_args, ctx.agent.sandbox)
    return await run_episode(ctx.client, ctx.url, ctx.tokenizer, env, prompt, params, ctx.agent, rid,
                             return_routed_experts=ctx.return_routed_experts, vision=ctx.vision)


async def run_episode(client, url: str, tokenizer, env, prompt, params, cfg: AgentConfig, rid: str,
                      fmt: ChatFormat | None = None, return_routed_experts: bool = False, vision=None) -> Sample:
    """Play one episode of `env` on `prompt` against the engine at `url`; always closes `env`.
    `vision`: a vision-language model's VisionProcessor (models/vision.py), else None."""
    fmt = fmt or ChatFormat(tokenizer, cfg.turn_end_token, cfg.observation_role)
    traj = _Trajectory(want_routed=return_routed_experts, vision=vision)
    try:
        first = await asyncio.to_thread(env.reset, prompt)
        text, images = _shown(first, "reset", getattr(prompt, "images", ()))
        traj.prompt_ids = await asyncio.to_thread(_laid_out, fmt.prompt_ids(text, len(images)), images, vision)
        traj.images += images
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
                  routed_experts=traj.routed, metadata=dict(prompt.metadata), images=tuple(traj.images))


def _shown(observation, where: str, default_images=()) -> tuple[str, tuple[PromptImage, ...]]:
    """An observation's text and images; plain text shows `default_images` (the prompt's, on reset)."""
    if isinstance(observation, Observation):
        return observation.text, _checked(observation.images, where)
    if isinstance(observation, str):
        return observation, tuple(default_images)
    raise TypeError(f"the environment's {where} returned {type(observation).__name__}: return a str, or an "
                    "Observation(text, images) (rollout/environments/contract.py)")


def _checked(images, where: str) -> tuple[PromptImage, ...]:
    """An Observation's images as PromptImages, each read and decoded once: PromptImages, encoded bytes,
    file paths or PIL images, one or a list. GenerationError (the group fails, naming the image) for
    one that cannot be used."""
    items = () if images is None else images if isinstance(images, (list, tuple)) else [images]
    raw = [item.bytes() if isinstance(item, PromptImage) else item for item in items]
    try:
        return row_images(raw, "images", f"the environment's {where} observation", os.getcwd(), max_pixels=0)
    except DataError as e:
        raise GenerationError(str(e)) from None


def _laid_out(ids: list[int], images: tuple[PromptImage, ...], vision) -> list[int]:
    """An observation's ids with each image placeholder expanded to its image's tokens."""
    if vision is None:
        if images:
            raise GenerationError("the environment showed images but the model has no vision tower: use a "
                                  "vision-language checkpoint or return text-only observations")
        return ids
    try:
        return vision.expand(ids, [vision.process(img.bytes()) for img in images])
    except ValueError as e:  # e.g. an observation's text holding the image placeholder token itself
        raise GenerationError(f"an observation's image tokens do not match its images: {e}") from None


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
    vision: object = None      # a vision-language model's VisionProcessor, else None
    images: list[PromptImage] = field(default_factory=list)  # the sequence's images, in the order of their tokens

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
                                   fmt.end_id, traj.current_rid, turn, traj.want_routed, traj.images, traj.vision)
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
        if traj.vision is not None and traj.vision.image_token_id in ids:
            traj.status = SampleStatus.TRUNCATED  # sent back, the sampled image token would read as an image
            traj.note = "the model sampled the image token"
            return
        text, images = _shown(step.observation, "step")
        obs = await asyncio.to_thread(_laid_out, fmt.observation_ids(text, closed, len(images)), images, traj.vision)
        if len(traj.ids) + len(obs) >= cfg.max_response_tokens:
            traj.status = SampleStatus.TRUNCATED  # no room left for another model turn
            return
        traj.append(obs, None, trained=False)
        traj.images += images
    traj.status = SampleStatus.TRUNCATED


async def _generate_turn(client, url, input_ids, params, max_new_tokens, end_id, rid, turn,
                         return_routed_experts: bool = False, images=(), vision=None) -> dict:
    sp = params.to_json()
    sp["max_new_tokens"] = max_new_tokens
    sp["stop_token_ids"] = [end_id]
    if params.seed is not None:
        sp["sampling_seed"] = (params.seed + 7919 * turn) & 0x7FFFFFFF
    body = {"input_ids": wire_ids(input_ids, images, vision), "sampling_params": sp, "return_logprob": True, "rid": rid}
    if images:
        body["image_data"] = [img.data for img in images]
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
