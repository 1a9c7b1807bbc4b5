"""Writes the example's dataset once (the committed train.jsonl and eval.jsonl are what run.sh uses).

The task: the sum of the digits of a three-digit number, asked in words as a chat message. Rows are in
slime's JSONL layout: `input` (a list of chat messages), `label` (the answer), `metadata` (extra
fields the reward receives). Seeded, so rerunning it rewrites the same files.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
EVAL_ROWS = 150


def row(n: int) -> dict:
    return {"input": [{"role": "user", "content": f"digit sum of {n}"}],
            "label": str(sum(int(d) for d in str(n))), "metadata": {"number": n}}


def main(out: Path = HERE) -> None:
    numbers = list(range(100, 1000))
    random.Random(0).shuffle(numbers)
    for name, part in (("eval.jsonl", numbers[:EVAL_ROWS]), ("train.jsonl", numbers[EVAL_ROWS:])):
        (out / name).write_text("".join(json.dumps(row(n)) + "\n" for n in part))


if __name__ == "__main__":
    main()
