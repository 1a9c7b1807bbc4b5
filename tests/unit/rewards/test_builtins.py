"""Built-in rewards: math answers through math-verify (boxed answers extracted), the boxed format
reward, exact match."""

from __future__ import annotations

import pytest

from miles.rewards.builtins import boxed_format, exact_match, last_boxed, math_reward


@pytest.mark.parametrize("response, label, expected", [
    ("The answer is \\boxed{1/2}.", "0.5", 1.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{3}", 0.0),
    ("first \\boxed{2} then \\boxed{3}", "3", 1.0),   # the last boxed answer counts
    ("x = 4", "4", 1.0),                               # no box: the last expression math-verify finds
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
    ("no answer at all", "7", 0.0),
    ("\\boxed{7}", None, 0.0),
])
def test_math_reward_checks_answers_with_math_verify(response, label, expected):
    assert math_reward(response, label) == expected


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{open") is None and last_boxed("none") is None
    assert boxed_format("so \\boxed{x}", None) == 1.0 and boxed_format("so x", None) == 0.0


def test_exact_match_strips_and_stringifies_labels():
    assert exact_match(" 42\n", "42") == 1.0 and exact_match("42", 42) == 1.0 and exact_match("4", None) == 0.0
