"""Images in the trainer's forward (vision-language policies, models/vision.py).

A micro-batch whose sequences carry images gets, beside its token ids, the pixel values of every
image (computed from the sample's bytes by the checkpoint's image processor, as the engine computed
them), the images' grids, and Qwen-VL's 3-D rotary positions of each sequence from its first token:
the same positions and the same image embeddings the engine used, so logprobs agree. Packed rows
also carry each sequence's 1-D positions first (4, 1, T), from which the model keeps packed
sequences from attending to each other.

Non-goal: freezing the vision tower (trainer.train_vision_tower, applied where the policy is loaded).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from miles.models.vision import ImageInputs, VisionProcessor, mrope_positions

CACHE = 256  # processed images kept, by digest of their bytes


@dataclass
class ImageBatch:
    pixel_values: torch.Tensor    # (patches of every image, D)
    image_grid_thw: torch.Tensor  # (images, 3)

    def to(self, device) -> "ImageBatch":
        return ImageBatch(self.pixel_values.to(device), self.image_grid_thw.to(device))

    def kwargs(self) -> dict:
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


class TrainerVision:
    """Pixel values and positions for micro-batches of one vision-language checkpoint."""

    def __init__(self, model_path: str):
        self.processor = VisionProcessor(model_path)
        self._cache: OrderedDict[str, ImageInputs] = OrderedDict()

    def _inputs(self, image) -> ImageInputs:
        hit = self._cache.get(image.digest)
        if hit is None:
            hit = self._cache[image.digest] = self.processor.process(image.bytes())
            if len(self._cache) > CACHE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(image.digest)
        return hit

    def batch(self, seqs, offsets: list[tuple[int, int]], B: int, width: int, pack: bool):
        """(ImageBatch or None when no sequence has images, position ids: (3, B, width) padded,
        (4, 1, width) packed, or None). `offsets[i]` = (row, column) where sequence i starts."""
        if not any(s.images for s in seqs):
            return None, None
        pos = torch.zeros((4 if pack else 3, B, width), dtype=torch.long)
        pixels, grids = [], []
        for s, (r, off) in zip(seqs, offsets):
            inputs = [self._inputs(img) for img in s.images]
            pixels += [i.pixel_values for i in inputs]
            grids += [i.grid for i in inputs]
            L = len(s.tokens)
            p3, _ = mrope_positions(s.tokens, [i.grid for i in inputs], self.processor.image_token_id,
                                    self.processor.merge)
            pos[-3:, r, off:off + L] = p3
            if pack:
                pos[0, r, off:off + L] = torch.arange(L)
        return ImageBatch(torch.cat(pixels), torch.tensor(grids, dtype=torch.long)), pos
