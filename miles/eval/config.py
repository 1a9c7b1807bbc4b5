"""What evaluation is told: the held-out greedy accuracy every run reports (`eval/accuracy`) and any
number of named eval sets (`[[eval.sets]]`), each with its own prompts, reward, sampling and metrics.

Non-goals: how samples are generated or scored (evaluator.py), the metric formulas (metrics.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from miles.config import ConfigError
from miles.eval.metrics import get_answer_fn
from miles.data.prompts import TaskConfig
from miles.rollout.reward import get_reward_fn

METRICS = ("pass", "avg", "maj")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class EvalSetConfig:
    """One eval set: its metrics are logged as eval/<name>/pass@k, avg@k, maj@k and accuracy."""

    name: str = ""
    """The set's name, used in its metric keys (letters, digits, _ . -); required and unique."""
    task: TaskConfig | None = None
    """Where its prompts come from (a table with the keys of [rollout.task]); default: rollout.task."""
    split: str = "eval"
    """The split of the task to draw from."""
    num_prompts: int = 64
    """Prompts to evaluate (the first ones of the split, fixed by run.seed)."""
    reward: str = ""
    """Reward function by name or module:function; empty = rollout.reward. A sample is correct as the
    reward says (its `correct`, or its declared threshold), else when its score is > 0."""
    correct_threshold: float | None = None
    """Count a sample correct when its score is >= this, whatever the reward says (unset: the reward's
    verdict, else score > 0); for a shaped reward that does not return `correct`."""
    n: int = 4
    """Samples per prompt for pass@k, avg@k and maj@k (0 = none: greedy accuracy only)."""
    k: list[int] = field(default_factory=list)
    """The k values to report (each 1..n); empty = 1 and n."""
    metrics: list[str] = field(default_factory=lambda: list(METRICS))
    """Which of pass, avg, maj to report for each k."""
    answer: str = "stripped"
    """How maj@k reads an answer from a response: stripped, boxed (last \\boxed{}), last_number, or
    module:function (response -> str or None)."""
    greedy: bool = True
    """Also decode each prompt greedily once and report eval/<name>/accuracy."""
    temperature: float = 1.0
    """Sampling temperature of the n samples."""
    top_p: float = 1.0
    """Nucleus sampling threshold of the n samples."""
    top_k: int = -1
    """Top-k sampling of the n samples (-1 = off)."""
    max_new_tokens: int = 16
    """Longest response in tokens (greedy and sampled)."""

    @property
    def ks(self) -> list[int]:
        if self.n < 1:
            return []
        return sorted(set(self.k or [1, self.n]))

    def check(self, where: str) -> None:
        """Raise ConfigError naming `where` (e.g. eval.sets[0]) and the key at fault."""
        if not _NAME.match(self.name):
            raise ConfigError(f"{where}.name: give each eval set a name of letters, digits, _ . - "
                              f"(got {self.name!r})")
        if self.num_prompts < 1:
            raise ConfigError(f"{where}.num_prompts must be >= 1")
        if self.n < 0:
            raise ConfigError(f"{where}.n must be >= 0 (0 = greedy accuracy only)")
        if self.n == 0 and not self.greedy:
            raise ConfigError(f"{where}: n = 0 and greedy = false leave nothing to measure; "
                              "set n >= 1 or greedy = true")
        bad_k = [k for k in self.k if not 1 <= k <= self.n]
        if bad_k:
            raise ConfigError(f"{where}.k: {bad_k[0]} is outside 1..n (n = {self.n}); list k values between 1 and n")
        unknown = [m for m in self.metrics if m not in METRICS]
        if unknown:
            raise ConfigError(f"{where}.metrics: unknown metric {unknown[0]!r}; choose from {', '.join(METRICS)}")
        if self.temperature <= 0 and self.n > 1:
            raise ConfigError(f"{where}.temperature must be > 0 when n > 1 (greedy samples are all alike); "
                              "use greedy = true for greedy accuracy")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{where}.top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"{where}.top_k = {self.top_k}: set -1 (off, the whole vocabulary) or a count >= 1")
        if self.max_new_tokens < 1:
            raise ConfigError(f"{where}.max_new_tokens must be >= 1")
        if "maj" in self.metrics and self.n >= 1:
            try:
                get_answer_fn(self.answer)
            except ValueError as e:
                raise ConfigError(f"{where}.answer: {e}") from None
        if self.reward:
            try:
                get_reward_fn(self.reward)
            except ValueError as e:
                raise ConfigError(f"{where}.reward: {e}") from None
        if self.task is not None:
            try:
                self.task.validate()
            except ConfigError as e:
                raise ConfigError(f"{where}.task: {e}") from None


@dataclass
class EvalConfig:
    every_steps: int = 10
    """Evaluate every this many steps (0 = only before and after training)."""
    num_prompts: int = 256
    """Held-out prompts per evaluation (greedy decoding)."""
    max_new_tokens: int = 16
    """Longest eval response in tokens."""
    correct_threshold: float | None = None
    """eval/accuracy counts a sample correct when its score is >= this, whatever the reward says
    (unset: the reward's verdict, else score > 0); eval sets have their own."""
    sets: list[EvalSetConfig] = field(default_factory=list)
    """Further eval sets ([[eval.sets]] tables), each evaluated with eval/accuracy; see docs/eval.md."""

    def validate(self) -> None:
        if self.every_steps < 0 or self.num_prompts < 1:
            raise ConfigError("eval.every_steps must be >= 0 and eval.num_prompts >= 1")
        if self.max_new_tokens < 1:
            raise ConfigError(f"eval.max_new_tokens = {self.max_new_tokens}: set it >= 1")
        seen: set[str] = set()
        for i, s in enumerate(self.sets):
            where = f"eval.sets[{i}]" + (f" ({s.name})" if s.name else "")
            s.check(where)
            if s.name in seen:
                raise ConfigError(f"{where}.name: {s.name!r} names two eval sets; give each set its own name")
            seen.add(s.name)
