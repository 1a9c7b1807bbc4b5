"""The `long` workload's reward in `miles bench trl`, one function for miles and TRL alike.

A response in the long format is the answer, then the answer repeated after `=` a variable number of
times (`045=045=045`): the repeats only lengthen the response. Non-goal: scoring the repeats.
"""

from __future__ import annotations


def answer_first(response: str, label: str | None) -> float:
    """1.0 when the text before the first `=` is the label exactly, else 0.0."""
    return float(label is not None and response.strip().split("=", 1)[0] == str(label).strip())
