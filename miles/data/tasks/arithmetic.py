"""Verifiable arithmetic: multi-digit addition and subtraction from a seeded generator.

A problem is `a+b=` or `a-b=` (a >= b, so answers are never negative); the answer is the exact
decimal result. With `fixed_width`, operands and answers are zero-padded (`07+38=045`), which keeps
each column at a fixed position and makes the task far easier for a small model to learn. Every (a, op, b) triple is assigned to train or eval by a stable hash, so the two
splits are disjoint for any seed and any number of draws.
Non-goal: natural-language word problems; this task exists to make reward exact and cheap.
"""

from __future__ import annotations

import hashlib
import random

from miles.data.tasks.contract import Problem


def _split_of(a: int, op: str, b: int, eval_fraction: float) -> str:
    h = int.from_bytes(hashlib.sha256(f"{a}{op}{b}".encode()).digest()[:8], "big")
    return "eval" if (h % 10_000) < eval_fraction * 10_000 else "train"


def solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


class ArithmeticTask:
    """Draws problems of one split, reproducibly from `seed`."""

    def __init__(self, digits: int = 2, ops: str = "+-", split: str = "train", seed: int = 0,
                 eval_fraction: float = 0.1, fixed_width: bool = False):
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if digits < 1 or digits > 9:
            raise ValueError(f"digits must be in 1..9, got {digits}")
        if not ops or set(ops) - {"+", "-"}:
            raise ValueError(f"ops must be a non-empty string of '+' and '-', got {ops!r}")
        self.digits, self.ops, self.split = digits, ops, split
        self.eval_fraction, self.fixed_width = eval_fraction, fixed_width
        self.rng = random.Random(f"{seed}:{split}")

    def draw(self) -> Problem:
        hi = 10 ** self.digits - 1
        while True:
            a, b = self.rng.randint(0, hi), self.rng.randint(0, hi)
            op = self.rng.choice(self.ops)
            if op == "-" and a < b:
                a, b = b, a
            if _split_of(a, op, b, self.eval_fraction) == self.split:
                return self._format(a, op, b)

    def _format(self, a: int, op: str, b: int) -> Problem:
        if not self.fixed_width:
            return Problem(prompt=f"{a}{op}{b}=", answer=str(solve(a, op, b)))
        # Worksheet layout: every column at the same position in every problem (07+38=045).
        w = self.digits
        return Problem(prompt=f"{a:0{w}d}{op}{b:0{w}d}=", answer=f"{solve(a, op, b):0{w + 1}d}")

    def take(self, n: int) -> list[Problem]:
        return [self.draw() for _ in range(n)]


def task_source(cfg, split: str, seed: int) -> ArithmeticTask:
    """The `arithmetic` prompt source from the run's task config (rollout.task)."""
    return ArithmeticTask(digits=cfg.digits, ops=cfg.ops, split=split, seed=seed, eval_fraction=cfg.eval_fraction,
                          fixed_width=cfg.fixed_width)


def demonstration(problem: Problem) -> str:
    """The SFT target text for a problem (the engine stops at EOS after it)."""
    return problem.prompt + problem.answer
