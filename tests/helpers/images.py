"""Small images drawn on the spot, as PNG bytes, for vision-language tests."""

from __future__ import annotations

import io

from PIL import Image, ImageDraw


def png(color: str = "red", size: tuple[int, int] = (32, 32), dot: tuple[int, int] | None = None) -> bytes:
    """A `size` PNG filled with `color`, with a black dot at `dot` when given."""
    img = Image.new("RGB", size, color)
    if dot is not None:
        x, y = dot
        ImageDraw.Draw(img).ellipse((x - 4, y - 4, x + 4, y + 4), fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
