"""A calculator tool for arithmetic problems.

The model may call the tool with a turn of the form `calc <expression>` and is shown the result as
a tool turn; any other turn is its final answer, scored 1.0 when it equals the reference exactly.
Only numbers, + - * // % and parentheses are evaluated (a parsed AST, never `eval`); zero-padded
numbers (`07+38`, the fixed-width problem layout) are read as decimal.
Non-goal: a general tool-call format (JSON function calling); this is the smallest tool that makes
tool use worth learning for a tiny model.
"""

from __future__ import annotations

import ast
import operator
import re

from miles.rollout.environments.contract import StepResult

TOOL_PREFIX = "calc "
_LEADING_ZEROS = re.compile(r"\b0+(?=\d)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod}


def evaluate(expression: str) -> str:
    """The integer value of `expression` as text, or `error: <why>`."""
    if len(expression) > 64:
        return "error: expression too long"
    try:
        # Python reads `07` as a syntax error (octal literals need 0o); the problems write it for 7.
        tree = ast.parse(_LEADING_ZEROS.sub("", expression.strip()), mode="eval")
        return str(_value(tree.body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e.__class__.__name__}"


def _value(node) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Mult) and max(abs(left), abs(right)) > 10**9:
            raise ValueError("operand too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("unsupported expression")


class CalculatorEnv:
    """One arithmetic episode: up to `max_tool_calls` calculator turns, then the final answer."""

    def __init__(self, max_tool_calls: int = 2):
        self.max_tool_calls = max_tool_calls
        self.label: str | None = None
        self.calls = 0

    def reset(self, task) -> str:
        self.label, self.calls = task.label, 0
        return task.text

    def step(self, action: str) -> StepResult:
        action = action.strip()
        if action.startswith(TOOL_PREFIX.strip()) and self.calls < self.max_tool_calls:
            self.calls += 1
            return StepResult(observation=evaluate(action[len(TOOL_PREFIX.strip()):]))
        return StepResult(observation="", reward=float(self.label is not None and action == self.label), done=True)

    def close(self) -> None:
        pass


def demonstration(task, use_tool: bool) -> list[tuple[str, str]]:
    """A solved episode as (role, text) turns after the user prompt: with or without the tool."""
    if not use_tool:
        return [("assistant", task.label)]
    expression = task.text.rstrip("=")
    return [("assistant", TOOL_PREFIX + expression), ("tool", evaluate(expression)), ("assistant", task.label)]
