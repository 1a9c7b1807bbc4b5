"""DataBuffer: the hand-off between rollout producers and the trainer, with the rules that keep
off-policy data bounded.

    prompt source ──draw/admit──► in flight ──put──► ready (bounded) ──get──► trainer
          ▲                                  │                         │
          └────────── retry queue ◄──────────┴── failed / stale ───────┘

On arrival (`put`) the fixed properties are judged at once: a group generation gave up on
(timeout, abort, engine failure) is retried or dropped (`on_failure`); a group the filter rejects
is discarded; a group that is already too stale follows `on_stale`. On the way out (`get`) staleness
is measured again against the trainer's current policy version, because it grows while a group
waits. Producers block when `capacity` groups are ready (backpressure) and when
`max_inflight_groups` are being generated; with `pacing` they also wait while the oldest group in
flight is about to become too stale, so engines finish long rollouts instead of starting new ones.

A checkpoint (`state_dict`) holds the ready groups, the retry queue, the ledger and the source's
position, and the prompts of the groups in flight: generation cannot be saved mid-request, so a
resumed run regenerates those groups from their prompts (partial samples are not kept), before any
retry or fresh prompt, and without spending one of the prompt's retries.

Thread-safe: producers and the trainer's `get` run on different threads. Non-goals: priorities,
sampling from the buffer more than once (each group is trained at most once).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

from miles.buffer.filters import get_filter
from miles.buffer.ledger import Ledger
from miles.buffer.staleness import staleness
from miles.buffer.types import Group, Reason, Sample, SampleStatus, Verdict
from miles.config.loader import ConfigError


@dataclass
class BufferConfig:
    capacity: int = 64
    """Most finished groups held for the trainer; producers wait when it is full."""
    max_inflight_groups: int = 16
    """Most groups being generated at once by the fully-async producer."""
    max_staleness: int = 2
    """Largest accepted (policy version − oldest weight version of a group) when the trainer collects it."""
    on_stale: Literal["retry", "drop"] = "drop"
    """What happens to a too-stale group: retry its prompt or drop it."""
    on_failure: Literal["retry", "drop"] = "retry"
    """What happens to a group generation gave up on (timeout, abort, engine failure, a failed reward
    with rollout.reward_config.on_error = drop_group)."""
    max_retries: int = 2
    """Retries per prompt; after that a failed or stale group is discarded with its reason."""
    filter: str = "nonzero_std"
    """Group filter by name (nonzero_std, none) or module:function returning True to keep."""
    pacing: bool = False
    """Stop admitting prompts while the oldest in-flight group would exceed max_staleness."""

    def validate(self) -> None:
        if self.capacity < 1 or self.max_inflight_groups < 1:
            raise ConfigError("buffer.capacity and buffer.max_inflight_groups must be >= 1")
        if self.max_staleness < 0 or self.max_retries < 0:
            raise ConfigError("buffer.max_staleness and buffer.max_retries must be >= 0")
        try:
            get_filter(self.filter)
        except ValueError as e:
            raise ConfigError(f"buffer.filter: {e}") from None


@dataclass
class _InFlight:
    prompt: object          # the data source's Prompt (index, text, label)
    start_version: int      # engine weight version when it was admitted (a lower bound on its oldest)


class BufferClosed(RuntimeError):
    """The buffer was closed while a caller waited on it."""


class DataBuffer:
    def __init__(self, cfg: BufferConfig, source):
        self.cfg, self.source = cfg, source
        self.filter = get_filter(cfg.filter)
        self.ledger = Ledger()
        self.policy_version = 0     # the trainer's version: optimizer steps taken
        self.weight_version = 0     # the newest version the engines are known to hold
        self._cond = threading.Condition()
        self._ready: deque[Group] = deque()
        self._inflight: dict[int, _InFlight] = {}
        self._retry: deque = deque()
        self._resumed: deque = deque()          # prompts in flight when the restored checkpoint was taken
        self._prompts: dict[int, object] = {}   # pending prompt index → Prompt, for retries
        self._retries: dict[int, int] = {}
        self._closed = False
        self._staleness_seen: list[int] = []
        self._stale_lengths: list[float] = []

    # -- versions --------------------------------------------------------------------------------
    def set_policy_version(self, version: int) -> None:
        with self._cond:
            self.policy_version = version
            self._cond.notify_all()  # pacing waits on it

    def set_weight_version(self, version: int) -> None:
        with self._cond:
            self.weight_version = version

    # -- producers ---------------------------------------------------------------------------------
    def draw(self, n: int) -> list:
        """n prompts for a synchronous batch (retries first), bypassing the in-flight bound."""
        with self._cond:
            return [self._next_prompt() for _ in range(n)]

    def draw_resumed(self) -> list:
        """Every prompt whose group was in flight when the restored checkpoint was taken (maybe none):
        the rest of the batch a resumed one-step-off run was generating, to be regenerated."""
        with self._cond:
            return [self._next_prompt() for _ in range(len(self._resumed))]

    def admit(self, timeout: float | None = None):
        """One prompt for the fully-async producer, once the in-flight bound and pacing allow.

        Returns None if `timeout` passes first; raises BufferClosed after `close()`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and self._admission_blocked():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            if self._closed:
                raise BufferClosed("the buffer is closed")
            return self._next_prompt()

    def _admission_blocked(self) -> bool:
        if len(self._inflight) >= self.cfg.max_inflight_groups:
            return True
        if self.cfg.pacing and self._inflight:
            oldest = min(f.start_version for f in self._inflight.values())
            # A group started at `oldest` is at the limit now; one more policy step makes it stale.
            return self.policy_version - oldest >= self.cfg.max_staleness
        return False

    def _next_prompt(self):
        if self._resumed:
            prompt = self._resumed.popleft()
            self.ledger.readmitted(prompt.index)
        elif self._retry:
            prompt = self._retry.popleft()
            self.ledger.readmitted(prompt.index)
        else:
            (prompt,) = self.source.take(1)
            self.ledger.drawn(prompt.index)
            self._prompts[prompt.index] = prompt
        self._inflight[prompt.index] = _InFlight(prompt, self.weight_version)
        return prompt

    def put(self, group: Group) -> tuple[Verdict | None, Reason | None]:
        """Judge a finished group on arrival; blocks while the buffer is full (backpressure).

        Returns (None, None) when the group was accepted into the buffer, else the verdict and reason.
        """
        with self._cond:
            index = group.prompt_index
            if index not in self._inflight:
                raise ValueError(f"put of a group for prompt {index}, which is not in flight; a group must "
                                 "come from a prompt handed out by draw() or admit()")
            try:
                if group.failure is not None:
                    return self._retry_or_drop(index, group.failure, self.cfg.on_failure)
                if not self.filter(group):
                    self.ledger.discarded(index, Reason.FILTERED)
                    self._forget(index)
                    return Verdict.DISCARDED, Reason.FILTERED
                if staleness(group, self.policy_version) > self.cfg.max_staleness:
                    self._note_stale(group)
                    return self._retry_or_drop(index, Reason.STALE, self.cfg.on_stale)
                while len(self._ready) >= self.cfg.capacity and not self._closed:
                    self._cond.wait()
                self._ready.append(group)
                self.ledger.buffered(index)
                return None, None
            finally:
                self._inflight.pop(index, None)
                self._cond.notify_all()

    # -- the trainer -------------------------------------------------------------------------------
    def get(self, n: int | None = None, timeout: float | None = None) -> list[Group]:
        """Collect n fresh groups (blocking), or with n=None every group ready now.

        Each group's staleness is measured here, against the current policy version; too-stale
        groups are retried or dropped and do not count towards n.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Group] = []
        with self._cond:
            while n is None or len(out) < n:
                if not self._ready:
                    if n is None:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if self._closed or (left is not None and left <= 0):
                        raise TimeoutError(
                            f"collected {len(out)} of {n} groups in {timeout}s with {len(self._inflight)} in "
                            "flight; engines may be stuck or too slow: check them, or raise "
                            "rollout.group_timeout_s / the collect timeout")
                    self._cond.wait(left)
                    continue
                group = self._ready.popleft()
                self._cond.notify_all()  # a producer may be waiting for room
                s = staleness(group, self.policy_version)
                if s > self.cfg.max_staleness:
                    self._note_stale(group)
                    self._retry_or_drop(group.prompt_index, Reason.STALE, self.cfg.on_stale)
                    continue
                self._staleness_seen.append(s)
                # Collected for the step that takes the policy from its current version to the next.
                self.ledger.trained(group.prompt_index, self.policy_version + 1)
                self._forget(group.prompt_index)
                out.append(group)
        return out

    # -- decisions ---------------------------------------------------------------------------------
    def _retry_or_drop(self, index: int, reason: Reason, policy: str) -> tuple[Verdict, Reason]:
        used = self._retries.get(index, 0)
        if policy == "retry" and used < self.cfg.max_retries:
            self._retries[index] = used + 1
            self.ledger.retried(index, reason)
            self._retry.append(self._prompts[index])
            return Verdict.RETRIED, reason
        self.ledger.discarded(index, reason)
        self._forget(index)
        return Verdict.DISCARDED, reason

    def _forget(self, index: int) -> None:
        self._prompts.pop(index, None)
        self._retries.pop(index, None)

    def _note_stale(self, group: Group) -> None:
        lens = [len(s.response_ids) for s in group.samples]
        self._stale_lengths.append(sum(lens) / max(len(lens), 1))

    # -- lifecycle and reporting ---------------------------------------------------------------------
    def close(self) -> None:
        """Wake every waiter; producers stop being admitted and `get` stops waiting."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def reopen(self) -> None:
        with self._cond:
            self._closed = False

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Ledger counters plus staleness of the groups collected since the last call."""
        with self._cond:
            out = self.ledger.metrics()
            out["buffer/ready"] = float(len(self._ready))
            out["buffer/retry_queue"] = float(len(self._retry))
            seen = self._staleness_seen
            out["buffer/staleness_mean"] = sum(seen) / len(seen) if seen else 0.0
            out["buffer/staleness_max"] = float(max(seen, default=0))
            ev = self.ledger.events
            out["buffer/dropped_stale"] = float(ev["discarded_stale"] + ev["retried_stale"])
            if self._stale_lengths:
                out["buffer/stale_response_len_mean"] = sum(self._stale_lengths) / len(self._stale_lengths)
            if reset:
                self._staleness_seen = []
            return out

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume: ready groups, prompts in flight and awaiting retry, the ledger.

        Groups in flight cannot be resumed mid-generation: their prompts are saved under "in_flight"
        and regenerated first after `load_state_dict` (their ledger state is retry_pending meanwhile).
        """
        with self._cond:
            ledger = self.ledger.state_dict()
            # Admission order, so a resumed batch regenerates its prompts in the order they were drawn.
            in_flight = [f.prompt for f in self._inflight.values()] + list(self._resumed)
            for p in in_flight:
                ledger["states"][p.index] = "retry_pending"
            return {
                "ready": [dataclasses.asdict(g) for g in self._ready],
                "in_flight": [dataclasses.asdict(p) for p in in_flight],
                "retry": [dataclasses.asdict(p) for p in self._retry],
                "prompts": [dataclasses.asdict(p) for p in self._prompts.values()],
                "retries": dict(self._retries),
                "ledger": ledger,
                "policy_version": self.policy_version,
                "weight_version": self.weight_version,
                # Taken under the same lock, so no prompt is drawn between the ledger and the source's position.
                "source": self.source.state_dict() if hasattr(self.source, "state_dict") else None,
            }

    def load_state_dict(self, state: dict, prompt_cls) -> None:
        """Restore from `state_dict()`; `prompt_cls` rebuilds the source's prompt objects."""
        with self._cond:
            self._ready = deque(_group_from_dict(g) for g in state["ready"])
            self._retry = deque(prompt_cls(**p) for p in state["retry"])
            # Checkpoints written before in-flight prompts were kept apart held them in "retry".
            self._resumed = deque(prompt_cls(**p) for p in state.get("in_flight", []))
            self._prompts = {p["index"]: prompt_cls(**p) for p in state["prompts"]}
            self._retries = {int(k): v for k, v in state["retries"].items()}
            self._inflight = {}
            self.ledger.load_state_dict(state["ledger"])
            self.policy_version = state["policy_version"]
            self.weight_version = state["weight_version"]


def _group_from_dict(d: dict) -> Group:
    samples = [Sample(**{**s, "status": SampleStatus(s["status"])}) for s in d["samples"]]
    failure = Reason(d["failure"]) if d.get("failure") else None
    return Group(samples=samples, prompt_index=d["prompt_index"], failure=failure)
