"""Vision-language checkpoints of the Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): how an image becomes
pixel values and image tokens, the same way wherever miles meets it (data, engine, trainer).

    VisionProcessor   the checkpoint's image processor (AutoImageProcessor) and its token rules:
                      an image → pixel values (patches, D) and a grid (t, h, w); its placeholder →
                      grid.prod() / merge² image tokens (what the model's AutoProcessor writes)
    mrope_positions   the 3-D rotary positions of a sequence holding images (t, h, w per image token)

Wire form vs trained form: the tokens miles records and trains on (TITO) have each image's
placeholder expanded to its image tokens. SGLang's /generate takes `input_ids` with ONE placeholder
per image and expands it itself (base_processor.build_input_ids), so requests carry `collapse(ids)`
and engines `expand` them back, which gives the same ids.

Qwen3-VL lays images out the same way (an image's (t, h, w) positions, text after it max(h, w) / merge
on); its tower's deepstack features, added into the first decoder layers at the image tokens, travel
beside the spliced embeddings (engine/multimodal.py, trainer/vision.py).

Non-goals: videos and audio (a checkpoint's video processor is never loaded; video tokens in a
request are refused by the engine).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from miles.data.images import decode_image

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Model types whose vision tower and 3-D rope miles serves and trains.
SUPPORTED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def is_vision_language(model_config: dict | None) -> bool:
    """Whether a checkpoint's config.json describes a vision-language model (it has a vision tower)."""
    return isinstance(model_config, dict) and isinstance(model_config.get("vision_config"), dict)


def check_supported(model_config: dict) -> None:
    kind = model_config.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"vision-language model_type {kind!r} is not supported by miles' engine and trainer "
                         f"(supported: {', '.join(SUPPORTED)}); serve it with SGLang and train a supported one")


@dataclass(frozen=True)
class ImageInputs:
    """One image as the vision tower takes it."""

    pixel_values: object   # torch.Tensor (patches, channels * temporal * patch²), float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    digest: str            # sha256 of the pixel values: the prefix cache's key for this image's tokens

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // (merge * merge)


class VisionProcessor:
    """A Qwen-VL checkpoint's image processor and image-token rules, read from its directory."""

    def __init__(self, model_path: str):
        from transformers import AutoImageProcessor

        config = json.loads((Path(model_path) / "config.json").read_text())
        check_supported(config)
        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id: int = config["image_token_id"]
        self.vision_start_id: int = config["vision_start_token_id"]
        self.merge: int = config["vision_config"]["spatial_merge_size"]

    def process(self, data: bytes, max_pixels: int = 0, what: str = "image") -> ImageInputs:
        out = self.image_processor(images=[decode_image(data, max_pixels, what)], return_tensors="pt")
        pixels = out["pixel_values"].float().contiguous()
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        return ImageInputs(pixels, grid, hashlib.sha256(pixels.numpy().tobytes()).hexdigest())

    def runs(self, ids) -> list[tuple[int, int]]:
        """(start, end) of each run of image tokens in `ids`, in order."""
        out, i, n = [], 0, len(ids)
        while i < n:
            if ids[i] == self.image_token_id:
                j = i
                while j < n and ids[j] == self.image_token_id:
                    j += 1
                out.append((i, j))
                i = j
            else:
                i += 1
        return out

    def collapse(self, ids: list[int]) -> list[int]:
        """The wire form: each image's run of tokens as one placeholder (SGLang's input_ids)."""
        out = list(ids)
        for a, b in reversed(self.runs(ids)):
            out[a:b] = [self.image_token_id]
        return out

    def expand(self, ids: list[int], images: list[ImageInputs]) -> list[int]:
        """Each image's placeholder as its grid's number of tokens; a run already that long is kept
        (ids recorded by miles). ValueError when the runs and the images disagree."""
        runs = self.runs(ids)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholders (token {self.image_token_id}) but "
                             f"{len(images)} images were sent: send one image per placeholder, in order")
        out = list(ids)
        for (a, b), img in reversed(list(zip(runs, images))):
            n = img.num_tokens(self.merge)
            if b - a not in (1, n):
                raise ValueError(f"an image placeholder run of {b - a} tokens does not match its image, which "
                                 f"takes {n} tokens (grid {img.grid}): send one placeholder per image")
            out[a:b] = [self.image_token_id] * n
        return out


def image_layout(grid: tuple[int, int, int], merge: int):
    """An image's rotary offsets (3, tokens) from the position its tokens start at, in (t, h, w)
    row-major order, and how far the text after it moves on: max(rows, cols)."""
    import torch

    t, h, w = grid
    H, W = h // merge, w // merge
    tt = torch.arange(t).repeat_interleave(H * W)
    hh = torch.arange(H).repeat_interleave(W).repeat(t)
    ww = torch.arange(W).repeat(t * H)
    return torch.stack([tt, hh, ww]), max(H, W)


def mrope_positions(ids, grids: list[tuple[int, int, int]], image_token_id: int, merge: int):
    """Qwen-VL's 3-D rotary positions (3, L) of `ids` (each image's tokens expanded) and the offset
    of the position after it from its length (negative: an image takes fewer positions than tokens).
    Text tokens step all three components by one; an image's tokens sit at start + image_layout, as
    the model's own get_rope_index places them."""
    import torch

    L = len(ids)
    pos = torch.empty((3, L), dtype=torch.long)
    cur, i, k = 0, 0, 0
    while i < L:
        if ids[i] != image_token_id:
            j = i
            while j < L and ids[j] != image_token_id:
                j += 1
            pos[:, i:j] = torch.arange(cur, cur + j - i)
            cur += j - i
            i = j
            continue
        offsets, advance = image_layout(grids[k], merge)
        k += 1
        n = offsets.shape[1]
        pos[:, i:i + n] = offsets + cur
        cur += advance
        i += n
    return pos, cur - L
