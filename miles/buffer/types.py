"""The data contract between rollout and training.

A Sample is one trajectory: prompt token ids, response token ids and what the trainer needs about
each response token. A Group is the n samples of one prompt; advantages are computed within it.
Token ids are kept end to end (TITO): nothing here is ever re-tokenized. A multimodal sample's
prompt ids hold each image's tokens already expanded (models/vision.py), and the images ride with it
as their encoded bytes, so engine and trainer compute the same pixel values from the same bytes.
"""

from __future__ import annotations

import base64
import enum
import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: its encoded file (PNG, JPEG, ...) as base64 text, and the sha256 of
    the bytes. Text, so samples stay JSON (checkpoints) and the image goes on the wire as it is
    (SGLang's `image_data` takes base64)."""

    data: str
    digest: str

    @staticmethod
    def of(raw: bytes) -> "PromptImage":
        return PromptImage(base64.b64encode(raw).decode("ascii"), hashlib.sha256(raw).hexdigest())

    def bytes(self) -> bytes:
        return base64.b64decode(self.data)


def as_images(values) -> tuple[PromptImage, ...]:
    """Images as a tuple of PromptImage, also from their JSON form (dicts, as a checkpoint holds them)."""
    return tuple(v if isinstance(v, PromptImage) else PromptImage(**v) for v in values or ())


class SampleStatus(str, enum.Enum):
    COMPLETED = "completed"  # the model stopped by itself (EOS or a stop condition)
    TRUNCATED = "truncated"  # hit max_new_tokens or the context length
    ABORTED = "aborted"      # generation gave up (abort, timeout, engine failure)


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]       # one per response token, from the engine
    loss_mask: list[int]                # one per response token; 0 = not trained on (e.g. tool output)
    reward: float = 0.0
    # Whether the reward says the response is right (rewards/contract.py); None when it does not say,
    # and evaluation then counts a score > 0 as right.
    correct: bool | None = None
    status: SampleStatus = SampleStatus.COMPLETED
    weight_versions: list[int] = field(default_factory=list)  # one per generated segment/turn
    response_text: str = ""
    label: str | None = None            # the reference answer, for verifiable rewards
    prompt_index: int = -1              # position of the prompt in the data source
    metadata: dict = field(default_factory=dict)  # the prompt's metadata (data source row fields)
    # MoE runs with routing replay: the engine's top-k expert ids of every token it fed through the
    # model, base64 int32 (tokens, MoE layers, top_k) as SGLang returns it (models/moe.py). They cover
    # prompt + response - 1 tokens, or fewer when the last tokens never reached the engine
    # (environment tokens after the final turn); uncovered tokens route freely in training.
    routed_experts: str | None = None
    # On-policy distillation with teacher engines: the teacher's logprob of every response token
    # (rollout/teacher.py); None when no teacher engine scored the sample.
    teacher_logprobs: list[float] | None = None
    # A segment came from an engine that held an older version than the one the whole fleet was known
    # to hold when the segment's request went out (an engine left behind by a commit round): never
    # expected; counted as rollout/off_fleet_samples.
    off_fleet: bool = False
    # A vision-language prompt's images, in the order of their tokens in prompt_ids.
    images: tuple[PromptImage, ...] = ()

    def __post_init__(self):
        self.images = as_images(self.images)
        n = len(self.response_ids)
        if len(self.rollout_logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(f"sample has {n} response tokens but {len(self.rollout_logprobs)} logprobs "
                             f"and {len(self.loss_mask)} loss-mask entries; they must match")

    @property
    def oldest_weight_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else 0


class Verdict(str, enum.Enum):
    """Where a group drawn from the prompt source ends up; every drawn prompt ends in exactly one."""
    TRAINED = "trained"
    RETRIED = "retried"      # its prompt went back to be generated again
    DISCARDED = "discarded"


class Reason(str, enum.Enum):
    """Why a group was retried or discarded (the suffix of its `buffer/...` counter)."""
    TIMEOUT = "timeout"                    # generation ran past the collection timeout
    ABORTED = "aborted"                    # the engine aborted a sample (pause, abort request)
    ENGINE_FAILURE = "engine_failure"      # the engine errored or could not be reached
    FILTERED = "filtered"                  # a group filter rejected it (default: all rewards equal)
    STALE = "stale"                        # its oldest weights were too far behind the policy
    REWARD_ERROR = "reward_error"          # a reward call failed and reward_config.on_error = drop_group


@dataclass
class Group:
    samples: list[Sample]
    prompt_index: int = -1              # the prompt's position in the data source (the ledger key)
    failure: Reason | None = None       # set when generation gave up on the group

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def oldest_weight_version(self) -> int:
        return min((s.oldest_weight_version for s in self.samples), default=0)
