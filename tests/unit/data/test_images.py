"""Rows with images in the layouts users bring (verl's `images` column beside messages with image
parts; TRL's conversational and plain prompts with `images` or `image`), as file paths, bytes or
`datasets` Image features, load into Prompts whose messages have one image part per image; bad
images (unreadable, empty, zero-size, too many pixels) are refused naming the file, row and field."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib

import datasets
import pytest

from miles.data.config import DataConfig
from miles.data.rows import DataError
from miles.data.prompts import PromptSource, TaskConfig
from tests.helpers.images import png


def _source(**data) -> PromptSource:
    data.setdefault("eval_fraction", 0.0)
    data.setdefault("shuffle", False)
    return PromptSource(TaskConfig(name="dataset", data=DataConfig(**data)), "train", 0)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_verl_parquet_with_images_column_and_image_parts(tmp_path):
    pics = [png("red"), png("blue")]
    rows = [{"data_source": "geo3k", "ability": "math",
             "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Angle {i}?"}]}],
             "images": [{"bytes": pics[i], "path": None}],
             "reward_model": {"style": "rule", "ground_truth": str(i)}} for i in range(2)]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    prompts = _source(path=str(path), layout="verl").take(2)
    assert [p.images[0].digest for p in prompts] == [hashlib.sha256(b).hexdigest() for b in pics]
    assert prompts[1].images[0].bytes() == pics[1]
    assert prompts[1].messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Angle 1?"}]}]
    assert prompts[1].text == "Angle 1?" and prompts[1].label == "1"
    assert "images" not in prompts[1].metadata


def test_trl_conversational_with_image_feature_from_save_to_disk(tmp_path):
    from PIL import Image
    import io

    pil = [Image.open(io.BytesIO(png(c))) for c in ("green", "white")]
    ds = datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": "What colour?"}]] * 2,
        "image": pil, "solution": ["green", "white"]}).cast_column("image", datasets.Image())
    ds.save_to_disk(str(tmp_path / "ds"))
    prompts = _source(path=str(tmp_path / "ds"), layout="trl").take(2)
    # No image part in the messages: TRL puts the image in front of the first user turn.
    assert prompts[0].messages == [{"role": "user", "content": [{"type": "image"},
                                                                {"type": "text", "text": "What colour?"}]}]
    assert len(prompts[1].images) == 1 and prompts[1].metadata == {"solution": "white"}


def test_trl_plain_prompt_with_image_paths(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png("red"))
    (tmp_path / "imgs" / "b.png").write_bytes(png("blue"))
    path = _jsonl(tmp_path / "train.jsonl", [{"prompt": "Which is red?", "images": ["imgs/a.png", "imgs/b.png"]}])
    (p,) = _source(path=path, layout="trl").take(1)
    assert [i.bytes() for i in p.images] == [png("red"), png("blue")]
    assert p.messages == [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                       {"type": "text", "text": "Which is red?"}]}]


def _png_header(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


@pytest.mark.parametrize("image, why", [
    (b"not an image at all", "cannot be read as an image"),
    (b"", "is empty (0 bytes)"),
    (_png_header(0, 0), "zero size"),  # Pillow refuses to open it; either way the row is refused
    (png("red", size=(100, 100)), "10000 pixels, over the limit of 4096"),
])
def test_bad_images_are_refused_naming_file_row_and_field(tmp_path, image, why):
    rows = [{"prompt": "fine", "label": "1", "images": [{"bytes": png("red"), "path": None}]},
            {"prompt": "bad", "label": "2", "images": [{"bytes": image, "path": None}]}]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with pytest.raises(DataError) as e:
        _source(path=str(path), max_image_pixels=4096)
    msg = str(e.value)
    assert f"{path} row 1: field 'images'" in msg
    assert why in msg or (why == "zero size" and "cannot be read" in msg), msg


def test_missing_image_file_and_count_mismatch_are_refused(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"prompt": "x", "label": "1", "images": ["nowhere.png"]}])
    with pytest.raises(DataError, match=r"row 0: field 'images': image file 'nowhere.png' does not exist"):
        _source(path=path)
    (tmp_path / "a.png").write_bytes(png())
    two_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    path = _jsonl(tmp_path / "b.jsonl", [{"prompt": two_parts, "label": "1", "images": ["a.png"]}])
    with pytest.raises(DataError, match=r"row 0: the messages have 2 image parts but field 'images' holds 1 images"):
        _source(path=path)
