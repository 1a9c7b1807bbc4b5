"""Teacher engines: a distillation teacher served over the engine HTTP API, scoring the student's
samples as part of the rollout.

Each finished group goes to one teacher engine as one batched `/generate` with `max_new_tokens: 0`,
`return_logprob: true` and `logprob_start_len` = prompt length − 1 (SGLang's input-token logprobs):
the reply's `meta_info.input_token_logprobs` from position prompt − 1 on are [None, log π_T(y_1), …,
log π_T(y_n)], so dropping the first entry gives the teacher's logprob of every response token. These
ride on the Sample (`teacher_logprobs`) to the trainer, so the teacher's forward overlaps with
generation under every schedule, as the rest of the rollout does.

Teacher engines are either started by the run (`teacher.model.path`, `teacher.num_engines`) or
already serving (`teacher.engine_urls`). They are never weight-sync targets: the fleet, the router
and every transport know only the student's engines. SGLang's input logprobs are untempered, so a
teacher engine scores at temperature 1 (the run refuses another rollout temperature).
Non-goals: health-checking or replacing teacher engines (a failed scoring call fails its group,
which buffer.on_failure retries), and the in-trainer teacher (trainer/teacher.py).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles.buffer.types import Sample
from miles.config.loader import ConfigError
from miles.engine_api import routes
from miles.models.loading import check_model_path
from miles.rollout.generate import GenerationError
from miles.trainer.teacher import tokenizer_mismatch

if TYPE_CHECKING:  # the run config imports this module, and loads without httpx
    from miles.engine_api.client import EngineClient


@dataclass
class TeacherModel:
    path: str = ""
    """Checkpoint directory (or hub id) of the teacher the run serves on engines of its own."""


@dataclass
class TeacherConfig:
    """A distillation teacher served by engines (algorithm `opd`); the alternative to the in-trainer
    teacher of trainer.algorithm.opd.teacher_path."""

    model: TeacherModel = field(default_factory=TeacherModel)
    """The teacher checkpoint, for engines the run starts."""
    num_engines: int = 1
    """Teacher engines the run starts from teacher.model.path (ignored with engine_urls)."""
    engine_urls: list[str] = field(default_factory=list)
    """Teacher engines already serving (SGLang servers or `miles serve`); the run neither starts nor stops them."""

    @property
    def enabled(self) -> bool:
        return bool(self.model.path or self.engine_urls)

    def validate(self) -> None:
        if self.model.path and self.engine_urls:
            raise ConfigError("teacher: set teacher.model.path (engines the run starts) or teacher.engine_urls "
                              "(engines already serving), not both")
        if self.model.path:
            try:
                check_model_path(self.model.path)
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"teacher.model.path: {e}") from None
            if self.num_engines < 1:
                raise ConfigError(f"teacher.num_engines = {self.num_engines}: a served teacher needs at least one "
                                  "engine; set teacher.num_engines >= 1")
        for url in self.engine_urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"teacher.engine_urls: {url!r} is not an http(s) URL")


def teacher_tokenizer_path(client: EngineClient, url: str) -> str:
    """Where a serving teacher's tokenizer lives, by its /get_model_info (SGLang's `tokenizer_path`)."""
    info = client.get(url, routes.GET_MODEL_INFO, timeout=30)
    return info.get("tokenizer_path") or info.get("model_path") or ""


def check_served_teacher(client: EngineClient, url: str, student_path: str) -> None:
    """Refuse a teacher engine whose tokenizer is not the student's (ConfigError with the reason)."""
    path = teacher_tokenizer_path(client, url)
    if not path:
        raise ConfigError(f"teacher engine {url} names no tokenizer this host can read ({path!r} from "
                          "/get_model_info), so its token ids cannot be checked against the student's; serve the "
                          "teacher from a checkpoint directory this host can read")
    try:
        why = tokenizer_mismatch(student_path, path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"teacher engine {url}: its tokenizer {path!r} (/get_model_info) cannot be loaded here "
                          f"({e}); serve the teacher from a checkpoint directory this host can read") from None
    if why:
        raise ConfigError(f"teacher engine {url} serves {path!r}, whose tokenizer is not model.path's ({why}); the "
                          "teacher scores the student's token ids, so serve a teacher trained with the student's "
                          "tokenizer")


class TeacherScorer:
    """Fills in `teacher_logprobs` of a group's samples, one batched scoring call per group, the
    groups spread round-robin over the teacher engines."""

    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("TeacherScorer needs at least one teacher engine URL")
        self.urls = list(urls)
        self._next = itertools.count()
        self._lock = threading.Lock()
        self.versions_seen: set[str] = set()  # the teacher engines' weight versions (never more than one)

    async def score_group(self, client, samples: list[Sample]) -> None:
        todo = [s for s in samples if s.response_ids]
        for s in samples:
            if not s.response_ids:
                s.teacher_logprobs = []
        if not todo:
            return
        with self._lock:
            url = self.urls[next(self._next) % len(self.urls)]
        body = {"input_ids": [s.prompt_ids + s.response_ids for s in todo], "return_logprob": True,
                # From the last prompt token: its entry is SGLang's None, every response token's follows.
                "logprob_start_len": [len(s.prompt_ids) - 1 for s in todo],
                "sampling_params": {"max_new_tokens": 0}}
        resp = await client.post(f"{url}/generate", json=body)
        if resp.status_code != 200:
            raise GenerationError(f"teacher {url}/generate answered {resp.status_code}: {resp.text[:300]}")
        outs = resp.json()
        if not isinstance(outs, list) or len(outs) != len(todo):
            raise GenerationError(f"teacher {url} answered a batch of {len(todo)} with a {type(outs).__name__}")
        for s, out in zip(todo, outs):
            meta = out["meta_info"]
            triples = meta.get("input_token_logprobs") or []
            if [t for _, t, *_ in triples[1:]] != s.response_ids:
                raise GenerationError(f"teacher {url} scored other tokens than the sample's response (is it an "
                                      "engine that returns input_token_logprobs for logprob_start_len?)")
            s.teacher_logprobs = [float(lp) for lp, *_ in triples[1:]]
            self.versions_seen.add(str(meta.get("weight_version")))
