"""Generate functions: how one prompt becomes one scored Sample, chosen by rollout.generate_fn.

    GenerateContext, GenerateFn   what a generate function is given, and its contract
    GENERATE_FNS                  the registry: single_turn (here), agent (agent/episode.py),
                                  harness (agent/harness.py), or a user's `module:function`
    generate, generate_many       single-turn generation: prompt token ids in, Samples with response
                                  ids and logprobs out, one request or a group's batch per POST

Talks to any server speaking the engine HTTP API (the built-in engine, SGLang, or a router in front
of them). Token ids are sent and received as ids (TITO); the text is only used for the reward.
A prompt with images sends them as SGLang's `image_data` (base64) with one placeholder token per
image in `input_ids` (the wire form, models/vision.py); its Sample keeps the expanded ids and the images.
Non-goals: multi-turn episodes (agent/, which sends its images the same way), scoring (the reward
runner, or the generate function itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from miles.buffer.types import PromptImage, Sample, SampleStatus
from miles.engine_api.sampling import SamplingParams
from miles.registry import Registry
from miles.rollout.config import AgentConfig
from miles.versions import from_wire

_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class GenerationError(RuntimeError):
    """The engine refused or failed a request; the message carries its reason."""


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
    vision: object = None              # a vision-language model's VisionProcessor (models/vision.py), else None


class GenerateFn(Protocol):
    async def __call__(self, ctx: GenerateContext, prompt, params, rid: str) -> Sample:
        """Turn one data-source Prompt into one Sample with its reward filled in (or, with the
        function's `scores_itself = False`, left to the run's reward runner)."""


async def single_turn(ctx: GenerateContext, prompt, params, rid: str) -> Sample:
    """One /generate call on the encoded prompt; the reward runner scores it (scores_itself = False)."""
    s = await generate(ctx.client, ctx.url, ctx.encode(prompt), params, rid=rid, label=prompt.label,
                       prompt_index=prompt.index, return_routed_experts=ctx.return_routed_experts,
                       images=prompt.images, vision=ctx.vision)
    s.metadata = dict(prompt.metadata)
    return s


single_turn.scores_itself = False  # type: ignore[attr-defined]


GENERATE_FNS: Registry[GenerateFn] = Registry(
    "generate function", arity=4, coroutine=True,
    hint=" (an `async def` taking (ctx, prompt, params, rid) and returning a Sample)")
GENERATE_FNS.register("single_turn", single_turn)
# The multi-turn ones by `module:attr`: naming one imports only its own module.
GENERATE_FNS.register("agent", "miles.rollout.agent.episode:multi_turn")
GENERATE_FNS.register("harness", "miles.rollout.agent.harness:harness")


def get_generate_fn(spec: str) -> GenerateFn:
    """The generate function `spec` names (registry name or `module:function`); RegistryError names the fix."""
    return GENERATE_FNS.get(spec)


async def generate(client, url: str, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
                   label: str | None = None, prompt_index: int = -1, return_routed_experts: bool = False,
                   images: tuple[PromptImage, ...] = (), vision=None) -> Sample:
    """POST /generate once and turn the reply into a Sample (reward filled in later). `images`:
    the prompt's, in the order of its image tokens; `vision` then gives their wire form."""
    body = {"input_ids": wire_ids(prompt_ids, images, vision), "sampling_params": params.to_json(),
            "return_logprob": True}
    if images:
        body["image_data"] = [img.data for img in images]
    if return_routed_experts:
        body["return_routed_experts"] = True
    if rid is not None:
        body["rid"] = rid
    out = await _post(client, url, body)
    s = _sample(out, url, prompt_ids, label, prompt_index, return_routed_experts)
    s.images = tuple(images)
    return s


async def generate_many(client, url: str, prompts: list[list[int]], params: list[SamplingParams],
                        rids: list[str] | None = None, label: str | None = None, prompt_index: int = -1,
                        return_routed_experts: bool = False, images: tuple[PromptImage, ...] = (),
                        vision=None) -> list[Sample]:
    """Several samples in one batched POST /generate (SGLang's list form of input_ids, sampling_params
    and rid); the reply is a list in the same order. One request per group instead of one per sample
    keeps the HTTP work of client, router and engine from competing with decoding for the CPU."""
    if len(params) != len(prompts) or (rids is not None and len(rids) != len(prompts)):
        raise ValueError(f"generate_many: {len(prompts)} prompts but {len(params)} sampling params"
                         + (f" and {len(rids)} rids" if rids is not None else ""))
    body = {"input_ids": [wire_ids(p, images, vision) for p in prompts],
            "sampling_params": [p.to_json() for p in params], "return_logprob": True}
    if images:  # SGLang's batch form: one list of images per request
        body["image_data"] = [[img.data for img in images] for _ in prompts]
    if return_routed_experts:
        body["return_routed_experts"] = True
    if rids is not None:
        body["rid"] = list(rids)
    out = await _post(client, url, body)
    if not isinstance(out, list) or len(out) != len(prompts):
        raise GenerationError(f"{url} answered a batch of {len(prompts)} with "
                              f"{len(out) if isinstance(out, list) else type(out).__name__} items")
    samples = [_sample(o, url, p, label, prompt_index, return_routed_experts) for o, p in zip(out, prompts)]
    for s in samples:
        s.images = tuple(images)
    return samples


def wire_ids(prompt_ids: list[int], images, vision) -> list[int]:
    """The ids a request sends: with images, each image's run of tokens as one placeholder."""
    if not images:
        return list(prompt_ids)
    if vision is None:
        raise GenerationError("the prompt has images but the model has no vision tower: use a vision-language "
                              "checkpoint or drop the images")
    return vision.collapse(prompt_ids)


async def _post(client, url: str, body: dict):
    resp = await client.post(f"{url}/generate", json=body)
    if resp.status_code != 200:
        raise GenerationError(f"{url}/generate answered {resp.status_code}: {resp.text[:300]}")
    return resp.json()


def _sample(out: dict, url: str, prompt_ids: list[int], label: str | None, prompt_index: int,
            return_routed_experts: bool) -> Sample:
    meta = out["meta_info"]
    ids = list(out["output_ids"])
    logprobs = [float(lp) for lp, *_ in meta.get("output_token_logprobs", [])]
    if len(logprobs) != len(ids):
        raise GenerationError(f"{url} returned {len(ids)} tokens but {len(logprobs)} logprobs")
    routed = routed_experts_of(meta, url, return_routed_experts)
    return Sample(
        prompt_ids=list(prompt_ids), response_ids=ids, rollout_logprobs=logprobs, loss_mask=[1] * len(ids),
        status=_STATUS.get(meta["finish_reason"]["type"], SampleStatus.ABORTED),
        weight_versions=versions_of(meta), response_text=out.get("text", ""),
        label=label, prompt_index=prompt_index, routed_experts=routed,
    )


def versions_of(meta: dict) -> list[int]:
    """The policy versions that wrote a reply, in order: from SGLang's `weight_versions` spans when the
    server sends them (an update landed mid-reply gives two), else its one string `weight_version`."""
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans and all(isinstance(s, dict) and "version" in s for s in spans):
        return [from_wire(s["version"]) for s in spans]
    return [from_wire(meta.get("weight_version"))]


def routed_experts_of(meta: dict, url: str, asked: bool) -> str | None:
    """The reply's routed experts when they were asked for; a server or router that dropped them
    would otherwise turn routing replay off without a word."""
    if not asked:
        return None
    routed = meta.get("routed_experts")
    if not isinstance(routed, str):
        raise GenerationError(f"{url} answered without meta_info.routed_experts although return_routed_experts "
                              "was sent: serve an MoE model on an engine that records them, behind a router that "
                              "forwards them (router.kind = 'miles')")
    return routed
