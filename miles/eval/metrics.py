"""Eval metrics over n scored samples per prompt: pass@k (the unbiased estimator), avg@k, maj@k, and
greedy accuracy; plus the answer extractors maj@k votes with.

Whether a sample is *correct* is the reward's to say (`is_correct`): an eval config's
`correct_threshold` when set (score >= it), else the reward's own verdict (a dict's `correct`, or a
reward's declared threshold: rewards/contract.py), else score > 0 (the rule `eval/accuracy` has
always used, which counts any partial credit as correct). For one prompt with n samples of which c
are correct:

- pass@k = 1 - C(n-c, k) / C(n, k), the chance that at least one of k samples drawn without
  replacement from the n is correct (Chen et al. 2021), computed as a product so it never overflows;
- avg@k  = the mean score of the prompt's first k samples;
- maj@k  = 1 when the answer most of the prompt's first k samples give is correct (as the first
  sample giving it is judged); answers come from an extractor, samples without one do not vote, and a
  tie goes to the answer given first; 0 when no sample has an answer;
- accuracy = the share of greedy samples that are correct.

Each is averaged over prompts. Non-goals: confidence intervals, bootstrap estimates, per-prompt output.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from miles.registry import Registry

AnswerFn = Callable[[str], "str | None"]
ANSWER_EXTRACTORS: Registry[AnswerFn] = Registry(
    "answer extractor", arity=1, hint=" (a function (response_text) -> answer str or None)")


def is_correct(score: float, correct: bool | None = None, threshold: float | None = None) -> bool:
    """Whether one sample counts as correct: score >= `threshold` when the eval config sets one (it
    decides, whatever the reward says); else the reward's verdict `correct`; else score > 0."""
    if threshold is not None:
        return score >= threshold
    if correct is not None:
        return correct
    return score > 0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt: 1 - C(n-c, k)/C(n, k), as 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def avg_at_k(scores: Sequence[float], k: int) -> float:
    """Mean score of the first k samples of one prompt."""
    if not 1 <= k <= len(scores):
        raise ValueError(f"avg@k needs 1 <= k <= {len(scores)} samples, got k={k}")
    return sum(scores[:k]) / k


def majority(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample giving the most frequent answer (None answers do not vote; a tie goes
    to the answer given first), or None when no sample has an answer."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, i)
    if not counts:
        return None
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[best]


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 when the majority answer of the first k samples is correct (see `majority`), else 0.0;
    `correct[i]` is whether sample i is (`is_correct`)."""
    if len(answers) != len(correct) or not 1 <= k <= len(correct):
        raise ValueError(f"maj@k needs one answer per sample and 1 <= k <= {len(correct)}, got k={k}")
    i = majority(answers[:k])
    return float(i is not None and correct[i])


def accuracy(correct: Sequence[bool]) -> float:
    """Share of (greedy) samples that are correct (`correct[i]` from `is_correct`)."""
    return sum(map(bool, correct)) / len(correct) if correct else 0.0


def prompt_metrics(scores: list[list[float]], correct: list[list[bool]], answers: list[list[str | None]] | None,
                   ks: Sequence[int], which: Sequence[str]) -> dict[str, float]:
    """Per-set figures `pass@k`, `avg@k`, `maj@k` (for each k and each metric in `which`), averaged over
    prompts; `scores[p]` are prompt p's n sample scores, `correct[p]` whether each is correct
    (`is_correct`), `answers[p]` their extracted answers."""
    out: dict[str, float] = {}
    n_prompts = len(scores)
    for k in ks:
        if "pass" in which:
            out[f"pass@{k}"] = sum(pass_at_k(len(c), sum(c), k) for c in correct) / n_prompts
        if "avg" in which:
            out[f"avg@{k}"] = sum(avg_at_k(s, k) for s in scores) / n_prompts
        if "maj" in which and answers is not None:
            out[f"maj@{k}"] = sum(maj_at_k(a, c, k) for a, c in zip(answers, correct)) / n_prompts
    return out


# -- answer extractors -------------------------------------------------------------------------------
@ANSWER_EXTRACTORS.register("stripped")
def stripped(response: str) -> str | None:
    """The whole response without surrounding whitespace (None when empty)."""
    return response.strip() or None


@ANSWER_EXTRACTORS.register("boxed")
def boxed(response: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces allowed), stripped; None when there is none."""
    start = response.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(response)):
        if response[j] == "{":
            depth += 1
        elif response[j] == "}":
            depth -= 1
            if depth == 0:
                return response[i:j].strip() or None
    return None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@ANSWER_EXTRACTORS.register("last_number")
def last_number(response: str) -> str | None:
    """The last integer or decimal in the response, as written (leading zeros and sign kept)."""
    found = _NUMBER.findall(response.replace(",", ""))
    return found[-1] if found else None


def get_answer_fn(spec: str) -> AnswerFn:
    """The extractor `spec` names (stripped, boxed, last_number, or module:function)."""
    return ANSWER_EXTRACTORS.get(spec)
