"""The built-in rewards: exact match, math answers (math-verify, boxed answers extracted), a
`\\boxed{}` format reward, a regex reward configured from the run config, and a synthetic one for
benchmarks. The weighted combination is the runner's (a sum over rollout.reward_config.weights).

Each says whether a sample is right the same way: `exact_match`, `math` and `text_parity` score 1.0
exactly when it is, and declare so (`correct_threshold = 1.0`); `boxed_format` and `regex` judge
the form of a response, not its answer, so they declare nothing and, inside `weighted`, leave the
verdict to the components that judge answers.

Non-goals: the contract (contract.py), running them (runner.py).
"""

from __future__ import annotations

import logging
import re

from miles.rewards.contract import Configured, RewardInput, reward


@reward(inline=True, correct_threshold=1.0)
def exact_match(response: str, label: str | None) -> float:
    """1.0 when the stripped response equals the label exactly, else 0.0."""
    return float(label is not None and response.strip() == str(label).strip())


@reward(inline=True, correct_threshold=1.0)
def text_parity(response: str, label: str | None) -> float:
    """1.0 when the response has an odd number of characters: a synthetic reward that even an
    untrained model earns about half the time, so every group carries signal (throughput benchmarks)."""
    return float(len(response) % 2)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1] if depth == 0 else None


@reward(correct_threshold=1.0)
def math_reward(response: str, label: str | None) -> float:
    """1.0 when the response's answer equals the label mathematically (math-verify: `\\boxed{1/2}`
    matches 0.5, `\\frac{1}{2}`), else 0.0. The last `\\boxed{}` answer is used when there is one,
    else the last expression math-verify finds. Timeouts are the runner's (reward_config.timeout_s)."""
    if label is None:
        return 0.0
    from math_verify import parse, verify  # lazily: sympy is slow to import

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    boxed = last_boxed(response)
    answer = parse(f"${boxed}$" if boxed is not None else response, parsing_timeout=None)
    label_text = str(label)
    gold = parse(label_text if "$" in label_text or "\\boxed" in label_text else f"${label_text}$",
                 parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return float(verify(gold, answer, timeout_seconds=None))


@reward(inline=True)
def boxed_format(response: str, label: str | None) -> float:
    """1.0 when the response puts an answer in `\\boxed{}`, else 0.0 (a format reward: it does not say
    whether the answer is right)."""
    return float(bool(last_boxed(response)))


def _build_regex(cfg):
    if not cfg.regex_pattern:
        raise ValueError("reward 'regex' needs rollout.reward_config.regex_pattern, e.g. '^<answer>.*</answer>$'")
    pattern = re.compile(cfg.regex_pattern, re.DOTALL)
    full = cfg.regex_full_match

    def regex(response: str, label: str | None) -> float:
        """1.0 when the response matches rollout.reward_config.regex_pattern, else 0.0 (a format reward:
        it does not say whether the answer is right)."""
        text = response.strip()
        return float(bool(pattern.fullmatch(text) if full else pattern.search(text)))
    return regex


REGEX = Configured(_build_regex)

__all__ = ["exact_match", "text_parity", "math_reward", "boxed_format", "last_boxed", "REGEX", "RewardInput"]
