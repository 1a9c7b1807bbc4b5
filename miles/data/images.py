"""Images in dataset rows, in the forms users bring, checked and turned into PromptImages.

A row's image field (verl's and TRL's `images`, TRL's single `image`) holds one image or a list; an
image is a file path (absolute, or relative to the data file's folder or the working directory),
raw bytes, a `datasets` Image feature as rows hold it ({"bytes", "path"}), or a PIL image. Each is
decoded once here, so an unreadable, empty or oversized image stops the run before it starts with
the file, row and field named. Messages then carry `{"type": "image"}` parts where the images go:
rows whose messages have none get them in front of the first user turn (as TRL does).

Non-goals: pixel values and image tokens (the model's processor, models/vision.py), videos.
"""

from __future__ import annotations

import io
import os

from miles.buffer.types import PromptImage
from miles.data.errors import DataError


class ImageError(ValueError):
    """An image miles cannot use (unreadable, empty, too many pixels): the message says which and why."""


def decode_image(data: bytes, max_pixels: int = 0, what: str = "image"):
    """An RGB PIL image from encoded bytes (PNG, JPEG, ...). ImageError names `what` and the problem:
    no bytes, bytes no image library reads, a zero-size image, or more than `max_pixels` (0 = no limit)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError(f"{what} is empty (0 bytes): give the image file's bytes or path")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except UnidentifiedImageError:
        raise ImageError(f"{what} cannot be read as an image (not a format Pillow recognises); "
                         "give a PNG, JPEG, WebP or another format Pillow reads") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"{what} cannot be read as an image ({type(e).__name__}: {e}); "
                         "give a PNG, JPEG, WebP or another format Pillow reads") from None
    w, h = img.size
    if w == 0 or h == 0:
        raise ImageError(f"{what} has zero size ({w}x{h} pixels)")
    if max_pixels and w * h > max_pixels:
        raise ImageError(f"{what} has {w}x{h} = {w * h} pixels, over the limit of {max_pixels} "
                         "(rollout.task.data.max_image_pixels): shrink the image or raise the limit")
    return img.convert("RGB")


def encode_png(image) -> bytes:
    """A PIL image as PNG bytes (how in-memory images, e.g. `datasets` Image features, travel)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def row_images(value, field: str, where: str, base_dir: str, max_pixels: int) -> tuple[PromptImage, ...]:
    """The checked images of one row's `field` (its value `value`: one image or a list of them)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for k, item in enumerate(items):
        what = f"{where}: field {field!r}" + (f" image {k}" if len(items) > 1 else "")
        raw = _raw(item, what, base_dir)
        try:
            decode_image(raw, max_pixels, what)
        except ImageError as e:
            raise DataError(str(e)) from None
        out.append(PromptImage.of(raw))
    return tuple(out)


def _raw(item, what: str, base_dir: str) -> bytes:
    if isinstance(item, dict):  # a `datasets` Image feature: bytes when embedded, else a path
        if item.get("bytes") is not None:
            return _raw(item["bytes"], what, base_dir)
        if item.get("path"):
            return _raw(item["path"], what, base_dir)
        raise DataError(f"{what} is an image record with neither bytes nor a path")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, str):
        path = item[len("file://"):] if item.startswith("file://") else item
        for candidate in ([path] if os.path.isabs(path) else [os.path.join(base_dir, path), path]):
            if os.path.isfile(candidate):
                try:
                    with open(candidate, "rb") as f:
                        return f.read()
                except OSError as e:
                    raise DataError(f"{what}: image file {candidate!r} cannot be read ({e.strerror})") from None
        raise DataError(f"{what}: image file {item!r} does not exist (paths are read relative to the data "
                        "file's folder, then the working directory)")
    if hasattr(item, "save") and hasattr(item, "size"):  # a PIL image
        return encode_png(item)
    raise DataError(f"{what} is a {type(item).__name__}; an image is a file path, bytes, a datasets Image "
                    "or a PIL image")


def count_image_parts(messages: list[dict]) -> int:
    return sum(1 for m in messages if isinstance(m["content"], list)
               for p in m["content"] if p.get("type") in ("image", "image_url"))


def place_images(messages: list[dict], n: int, field: str, where: str) -> list[dict]:
    """`messages` with one image part per image: as they are when they hold n image parts, with n
    parts put in front of the first user turn when they hold none; DataError otherwise."""
    have = count_image_parts(messages)
    if have == n:
        return messages
    if have:
        raise DataError(f"{where}: the messages have {have} image parts but field {field!r} holds {n} images; "
                        "give one image per {\"type\": \"image\"} part")
    out = [dict(m) for m in messages]
    for m in out:
        if m["role"] == "user":
            text = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            m["content"] = [{"type": "image"} for _ in range(n)] + text
            return out
    raise DataError(f"{where}: the row has images but no user message to show them in")
