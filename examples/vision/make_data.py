"""Draws the example's images and writes its rows (verl's layout: an `images` column beside chat
messages with an image part), so nothing binary is committed. Seeded: the same files every time.

The task: how many dots are in the picture (1 to 4)? Each 32x32 image holds that many black dots
on white, at random places that do not overlap. 32x32 pixels are 4 image tokens of tiny-qwen-vl.

    python examples/vision/make_data.py OUT_DIR      # writes OUT_DIR/train.parquet, OUT_DIR/eval.parquet
"""

import io
import random
import sys
from pathlib import Path

import datasets
from PIL import Image, ImageDraw

SIZE, RADIUS, MAX_DOTS = 32, 3, 4
TRAIN_ROWS, EVAL_ROWS = 4000, 200
QUESTION = "How many dots?"


def draw(n: int, rng: random.Random) -> bytes:
    img = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(img)
    centres: list[tuple[int, int]] = []
    while len(centres) < n:
        x, y = rng.randint(RADIUS, SIZE - 1 - RADIUS), rng.randint(RADIUS, SIZE - 1 - RADIUS)
        if all((x - a) ** 2 + (y - b) ** 2 > (2 * RADIUS + 2) ** 2 for a, b in centres):
            centres.append((x, y))
            pen.ellipse((x - RADIUS, y - RADIUS, x + RADIUS, y + RADIUS), fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def row(rng: random.Random) -> dict:
    n = rng.randint(1, MAX_DOTS)
    return {"data_source": "dots", "ability": "counting",
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
            "images": [{"bytes": draw(n, rng), "path": None}],
            "reward_model": {"style": "rule", "ground_truth": str(n)}}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train", TRAIN_ROWS, 0), ("eval", EVAL_ROWS, 1)):
        rng = random.Random(seed)
        datasets.Dataset.from_list([row(rng) for _ in range(count)]).to_parquet(str(out / f"{name}.parquet"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
