"""Images in the trainer's forward (vision-language policies, models/vision.py).

A micro-batch whose sequences carry images gets, beside its token ids, the pixel values of every
image (computed from the sample's bytes by the checkpoint's image processor, as the engine computed
them), the images' grids, where their tokens are, and Qwen-VL's 3-D rotary positions of each
sequence from its first token: the same positions and image embeddings the engine used, so logprobs
agree. Packed rows also carry each sequence's 1-D positions first (4, 1, T), from which the model
keeps packed sequences from attending to each other.

A sequence's images are the first runs of image tokens, one per image (Sample.images, in order):
the prompt's, then those of environment replies in an agent episode (rollout/agent/episode.py),
which all come before any image token the model sampled, because an episode ends before a sampled
image token would be sent back to the engine. A model may sample the image token itself; the engine
feeds such a token back as text (its own embedding, one position), so here too: the vision tower's
output is spliced in at the images' tokens only, by a hook on the language model's input
(`spliced_into`) rather than by the model's own forward, which would take every image token for an
image. The hook runs inside the policy's forward, where a sharded policy's weights are gathered.

Non-goal: freezing the vision tower (trainer.train_vision_tower, applied where the policy is loaded).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from miles.models.vision import ImageInputs, VisionProcessor, mrope_positions

CACHE = 256  # processed images kept, by digest of their bytes


@dataclass
class ImageBatch:
    pixel_values: torch.Tensor    # (patches of every image, D)
    image_grid_thw: torch.Tensor  # (images, 3)
    mask: torch.Tensor            # (B, T) bool: the images' tokens, in the images' order row-major

    def to(self, device) -> "ImageBatch":
        return ImageBatch(self.pixel_values.to(device), self.image_grid_thw.to(device), self.mask.to(device))

    @contextmanager
    def spliced_into(self, model):
        """For forwards of `model` (a Qwen-VL causal LM) within: the vision tower's output of these
        images in place of the input embeddings at `mask` (and Qwen3-VL's deepstack features added
        after the first decoder layers there)."""
        visual, language = model.model.visual, model.model.language_model

        def splice(_module, args, kwargs):
            embeds = kwargs["inputs_embeds"]  # (B, T, H)
            tower = visual(self.pixel_values.to(embeds.dtype), grid_thw=self.image_grid_thw)
            kwargs["inputs_embeds"] = embeds.masked_scatter(self.mask[..., None], tower.pooler_output.to(embeds.dtype))
            deep = getattr(tower, "deepstack_features", None)
            if deep:  # Qwen3-VL: per early decoder layer, (image tokens, H) added to its output at `mask`
                kwargs["visual_pos_masks"] = self.mask
                kwargs["deepstack_visual_embeds"] = [d.to(embeds.dtype) for d in deep]
            return args, kwargs

        handle = language.register_forward_pre_hook(splice, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


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
        mask = torch.zeros((B, width), dtype=torch.bool)
        image_token = self.processor.image_token_id
        pixels, grids = [], []
        for s, (r, off) in zip(seqs, offsets):
            inputs = [self._inputs(img) for img in s.images]
            pixels += [i.pixel_values for i in inputs]
            grids += [i.grid for i in inputs]
            ids = self._as_laid_out(s.tokens, inputs)
            L = len(ids)
            full, _ = mrope_positions(ids, [i.grid for i in inputs], image_token, self.processor.merge)
            pos[-3:, r, off:off + L] = full
            mask[r, off:off + L] = torch.tensor(ids) == image_token
            if pack:
                pos[0, r, off:off + L] = torch.arange(L)
        return ImageBatch(torch.cat(pixels), torch.tensor(grids, dtype=torch.long), mask), pos

    def _as_laid_out(self, tokens: list[int], inputs: list[ImageInputs]) -> list[int]:
        """`tokens` with every image token after the images' runs as -1: text the model sampled, which
        neither the vision tower nor the 3-D layout touches. ValueError when the runs do not fit the images."""
        runs = self.processor.runs(tokens)
        if len(runs) < len(inputs):
            raise ValueError(f"a sequence has {len(inputs)} images but {len(runs)} runs of image tokens: its "
                             "sample's images must match its image tokens, in order")
        for (a, b), image in zip(runs, inputs):
            if b - a != image.num_tokens(self.processor.merge):
                raise ValueError(f"a run of {b - a} image tokens stands for an image of "
                                 f"{image.num_tokens(self.processor.merge)} tokens (grid {image.grid}): its "
                                 "sample's images must match its image tokens, in order")
        ids = list(tokens)
        for a, b in runs[len(inputs):]:
            ids[a:b] = [-1] * (b - a)
        return ids
