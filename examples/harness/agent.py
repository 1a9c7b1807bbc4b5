"""A small agent program written only against the `openai` client: it offers the model a calculator
tool, streams every reply, runs the calls the model makes, and scores the final answer.

miles runs it once per sample (rollout.generate_fn = "harness") against a fresh session of the run,
either as a command (`harness.command = "python examples/harness/agent.py"`: OPENAI_BASE_URL and
OPENAI_API_KEY point at the session, MILES_EPISODE names a JSON file with prompt and label; the last
line it prints is its reward) or in the rollout process (`harness.function =
"examples.harness.agent:episode"`, the async entry below; no process start per episode). Either way
the reward is 1 when the final answer is the label's number, else 0. Run it by hand against
`miles sessions` the same way (set the two variables and MILES_EPISODE).
"""

import ast
import asyncio
import json
import operator
import os
import re

import openai

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression such as 12*(3+4).",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
MAX_TURNS = 3
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only integers with + - * are supported")

    try:
        # Zero-padded operands (07+38) are plain integers here; Python's parser would refuse them.
        return str(ev(ast.parse(re.sub(r"\b0+(\d)", r"\1", expression), mode="eval").body))
    except (SyntaxError, ValueError) as e:
        return f"error: {e}"


async def reply(client: openai.AsyncOpenAI, messages: list[dict]) -> tuple[str, list[dict]]:
    """One streamed turn: its content and its tool calls, assembled from the deltas."""
    content, calls = "", {}
    stream = await client.chat.completions.create(model="miles", messages=messages, tools=TOOLS, stream=True)
    async for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = tc.id or call["id"]
            if tc.function is not None:
                call["function"]["name"] += tc.function.name or ""
                call["function"]["arguments"] += tc.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


def score(answer: str, label: str | None) -> float:
    """1 when the answer is the label's number (045 and 45 alike), else 0."""
    try:
        return float(int(answer.strip()) == int((label or "").strip()))
    except ValueError:
        return 0.0


async def solve(client: openai.AsyncOpenAI, prompt: str, label: str | None) -> float:
    messages = [{"role": "user", "content": prompt}]
    for _ in range(MAX_TURNS):
        content, calls = await reply(client, messages)
        if not calls:
            return score(content, label)
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for call in calls:
            try:
                expr = json.loads(call["function"]["arguments"]).get("expr", "")
            except ValueError:
                expr = ""
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calculate(str(expr))})
    return 0.0  # no answer within MAX_TURNS


async def episode(ep) -> float:
    """harness.function entry: one episode against the session ep.base_url names."""
    async with openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0) as client:
        return await solve(client, ep.prompt, ep.label)


def main() -> None:
    task = json.load(open(os.environ["MILES_EPISODE"]))

    async def run() -> float:
        async with openai.AsyncOpenAI(max_retries=0) as client:  # OPENAI_BASE_URL / OPENAI_API_KEY
            return await solve(client, task["prompt"], task["label"])

    print(json.dumps({"reward": asyncio.run(run())}))


if __name__ == "__main__":
    main()
