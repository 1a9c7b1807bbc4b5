"""A small agent program written only against the `openai` client: it offers the model a calculator
tool, runs the calls the model makes, asks for the final answer and prints its reward.

miles runs it once per sample (rollout.generate_fn = "harness") with OPENAI_BASE_URL and
OPENAI_API_KEY pointing at a fresh session; it reads the task from MILES_EPISODE (a JSON file with
prompt, label, metadata). The last line it prints is its reward: 1 when the final answer equals the
label, else 0. Run it by hand against `miles sessions` the same way (set the two variables).
"""

import ast
import json
import operator
import os

import openai

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 12*(3+4).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
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
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as e:
        return f"error: {e}"


def main() -> None:
    episode = json.load(open(os.environ["MILES_EPISODE"]))
    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "user", "content": episode["prompt"]}]
    answer = ""
    for _ in range(3):
        reply = client.chat.completions.create(model="miles", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            answer = reply.content or ""
            break
        for call in reply.tool_calls:
            result = calculate(json.loads(call.function.arguments).get("expression", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(json.dumps({"reward": float(answer.strip() == (episode["label"] or "").strip())}))


if __name__ == "__main__":
    main()
