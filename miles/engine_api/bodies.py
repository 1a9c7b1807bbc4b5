"""Typed bodies of the engine's routes: SGLang's control requests, miles' extension fields on them,
and the published (OpenAPI) shape of /generate.

Field names, types and defaults follow SGLang's own request structs (io_struct.py of the pinned
release). Each `Miles*` subclass adds the fields of a miles extension (extensions.py); an engine in
SGLang-only mode parses with the plain model, so a miles field is refused there as SGLang would
refuse it. Strict: no coercion (a version sent as 7 instead of "7" is refused, as SGLang's schema
refuses it).
Non-goal: checking /generate itself (parsing.py checks it by hand, to name the field of a batch).
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles.engine_api.errors import InvalidRequest
from miles.engine_api.parsing import MAX_ITEMS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_K


# ---- /generate's body, published ---------------------------------------------------------------
# parse_generate checks the body by hand (batches, per-item lists, messages naming the field); these
# models only publish its shape in the OpenAPI schema, so schema-driven clients and fuzzers see it.


NonNegInt = Annotated[int, Field(ge=0)]
StartLen = Annotated[int, Field(ge=-1)]


class SamplingParamsBody(BaseModel):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K, description="-1 or >= 1")
    min_p: float = Field(0.0, ge=0, le=1)
    max_new_tokens: int | None = Field(None, ge=0)
    stop: str | list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[NonNegInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    sampling_seed: int | None = Field(None, ge=0, le=2**63 - 1)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: Literal[1] = 1


class GenerateBody(BaseModel):
    """One prompt, or a batch (lists of prompts, with one value or a list of values per field)."""

    input_ids: list[NonNegInt] | list[list[NonNegInt]] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    return_logprob: bool | list[bool] = False
    rid: str | list[str] | None = None
    stream: bool = False
    return_text_in_logprobs: bool = False
    logprob_start_len: StartLen | list[StartLen] | None = None
    top_logprobs_num: Literal[0] | None = 0
    return_routed_experts: bool = False
    lora_path: str | list[str | None] | None = None


def openapi_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` of a route that reads its JSON body by hand: publishes `model` as the body."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None:
                return inline(defs[ref.rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


# ---- SGLang's control requests, as typed models (see the module docstring) ----------------------


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


Selector = Literal["target", "draft", "all"]


class InitWeightsUpdateGroup(Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2, le=1 << 16)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroup(Body):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributed(Body):
    names: list[str] = Field(max_length=MAX_ITEMS)
    dtypes: list[str] = Field(max_length=MAX_ITEMS)
    shapes: list[list[NonNegInt]] = Field(max_length=MAX_ITEMS)
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


class MilesUpdateWeightsFromDistributed(UpdateWeightsFromDistributed):
    """+ staged commit: commit=false stages the bucket, reset_staging drops what an earlier one left."""

    names: list[str] = Field(default_factory=list, max_length=MAX_ITEMS)
    dtypes: list[str] = Field(default_factory=list, max_length=MAX_ITEMS)
    shapes: list[list[NonNegInt]] = Field(default_factory=list, max_length=MAX_ITEMS)
    commit: bool = True
    reset_staging: bool = False
    screened: bool = False
    """flattened_small: the sender found no NaN/Inf in these bytes, so the engine stages them unread."""


class UpdateWeightFromDisk(Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class MilesUpdateWeightFromDisk(UpdateWeightFromDisk):
    """+ staged commit (a transport's load_format may stage without applying)."""

    model_path: str | None = None
    commit: bool = False  # a transport's own load_format stages until told; a checkpoint load always applies
    reset_staging: bool = False


class UpdateWeightVersion(Body):
    new_version: str
    abort_all_requests: bool = True


class BeginWeightUpdate(Body):
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdate(Body):
    pass


class CheckWeights(Body):
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Selector = "all"


class MilesCheckWeights(CheckWeights):
    """+ checked weights: a noise seed, an expected checksum table, per-bucket checksums."""

    seed: int = 0
    expected: dict[str, list[str]] | None = None
    buckets: list[list[list[str]]] | None = None
    digest: Literal["xxh3", "sum64"] = "xxh3"  # sum64: the device_digest extension (sync/verify.py)


class PauseGeneration(Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGeneration(Body):
    torch_empty_cache: bool = True


class Abort(Body):
    rid: str | None = None
    abort_all: bool = False


class LoadLoRAAdapter(Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    pinned: bool = False
    lora_id: str | None = None  # SGLang fills it in itself; accepted and unused


class UnloadLoRAAdapter(Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_id: str | None = None


class MemoryTags(Body):
    tags: list[str] | None = None


BodyT = TypeVar("BodyT", bound=Body)


def parse_body(model: type[BodyT], body: dict) -> BodyT:
    """`body` as `model`, or InvalidRequest naming the first bad field and what it should be."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            known = sorted(model.model_fields)
            raise InvalidRequest(f"{where}: unknown field; supported fields are {known}") from None
        raise InvalidRequest(f"{where}: {err['msg']}") from None


def parse_memory_tags(body: dict, known: tuple[str, ...]) -> tuple[str, ...]:
    """SGLang's optional `tags` list; absent or null means every kind of memory."""
    tags = parse_body(MemoryTags, body).tags
    if tags is None:
        return known
    if not tags:
        raise InvalidRequest(f"tags: expected a non-empty list drawn from {list(known)}")
    bad = [t for t in tags if t not in known]
    if bad:
        raise InvalidRequest(f"tags: {bad[0]!r} is not a memory kind; use any of {list(known)}")
    return tuple(dict.fromkeys(tags))


