"""Images in the built-in engine (vision-language models, models/vision.py).

A request's images arrive as SGLang's `image_data` (base64 or data URLs). At admission each becomes
pixel values (the checkpoint's image processor), its placeholder is expanded to the image's tokens,
and each of those tokens is replaced, in the request's ids, by an image key: a negative id naming the
image (by the sha256 of its pixel values, interned to a serial) and the token's index in it. So the
prefix cache, the dedup of identical prompts and the shared-prefix prefill, which all compare ids,
share KV between identical images and never between different ones, with no change of their own.

At prefill (`inputs`): the vision tower runs once per image (its embeddings are kept for the weights
in force, so copies of a prompt and later turns reuse them), the embeddings are spliced in at the
image keys, and every row gets Qwen-VL's 3-D rotary positions over its whole sequence, of which the
computed suffix takes its share. Qwen3-VL's tower also gives deepstack features, one (tokens, hidden)
per early decoder layer, which the model adds to those layers' outputs at the image tokens; the
model's own forward does so only when it runs the tower itself on every image token of its input,
so the engine hands them to the language model (`Deepstack.injected`) for the image keys of the
computed suffix, the rows of an image cut by a cached prefix included. Decode steps hold no image
token, and add nothing. The text after an image sits at fewer positions than tokens, so
each row's next position is its length plus an offset (`delta`); decode then goes on as for text:
one position per token, the same in all three components.

Non-goals: videos; image URLs or file paths in requests (an engine reads no files or network on a
client's behalf); LoRA adapters on a vision-language model.
"""

from __future__ import annotations

import base64
import binascii
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from miles.engine_api.errors import InvalidRequest
from miles.models.loading import read_model_config
from miles.models.vision import ImageInputs, VisionProcessor, image_layout, is_vision_language

_INDEX_BITS = 20  # tokens of one image: up to about a million
MAX_SERIALS = 1 << 16  # distinct images remembered for prefix-cache keys (oldest forgotten first)
EMBED_CACHE = 64  # images whose vision-tower output is kept


def is_image_key(token: int) -> bool:
    return token < 0


def image_key(serial: int, index: int) -> int:
    return -((serial << _INDEX_BITS) | index) - 1


def key_parts(token: int) -> tuple[int, int]:
    n = -token - 1
    return n >> _INDEX_BITS, n & ((1 << _INDEX_BITS) - 1)


@dataclass(eq=False)
class ServedImage:
    """One image of a request: its pixels, its serial and its tokens' layout."""

    inputs: ImageInputs
    serial: int
    offsets: torch.Tensor  # (3, tokens) rotary offsets from the image's first position
    advance: int           # positions the image moves the text after it on


@dataclass(eq=False)
class Deepstack:
    """Qwen3-VL's deepstack features of one prefill's image keys."""

    mask: torch.Tensor    # (R, S) bool: the image keys of the computed suffixes
    embeds: torch.Tensor  # (layers, keys, hidden): one row per True in `mask`, row-major

    @contextmanager
    def injected(self, model):
        """For forwards of `model` within: these features added after its first decoder layers at
        `mask`, as its own forward adds them when it runs the tower."""
        def inject(_module, args, kwargs):
            kwargs["visual_pos_masks"] = self.mask
            kwargs["deepstack_visual_embeds"] = list(self.embeds)
            return args, kwargs

        handle = model.model.language_model.register_forward_pre_hook(inject, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


class ImageTable:
    """The engine's images: interning by pixel digest, image keys, and vision-tower outputs."""

    def __init__(self, model_path: str, model):
        self.vision = VisionProcessor(model_path)
        self.model = model
        self.image_token_id = self.vision.image_token_id
        self._lock = threading.Lock()
        self._serials: OrderedDict[str, int] = OrderedDict()  # digest -> serial, least recent first
        self._next = 0
        self._live: weakref.WeakValueDictionary[int, ServedImage] = weakref.WeakValueDictionary()
        # serial -> (epoch, (n, H) embeddings, (layers, n, H) deepstack features or None)
        self._embeds: OrderedDict[int, tuple[int, torch.Tensor, torch.Tensor | None]] = OrderedDict()

    @classmethod
    def serving(cls, config, model) -> "ImageTable | None":
        """The table of an engine (EngineConfig `config`) serving `model`; None for a text model.
        Refuses what cannot serve a vision-language model, naming the setting."""
        if not is_vision_language(read_model_config(config.model_path)):
            return None
        if config.quantization != "none":
            raise ValueError(f"rollout.engine.quantization = {config.quantization!r} is not supported for a "
                             "vision-language model (its vision tower and image splice are served as loaded): "
                             "set it to 'none'")
        return cls(config.model_path, model)

    # ---- admission (any thread) -------------------------------------------------------------

    def admit(self, ids: list[int], image_data: list[str]) -> tuple[tuple[int, ...], tuple[ServedImage, ...]]:
        """A request's ids with its images' tokens expanded and keyed, and its images (kept alive by
        the request). InvalidRequest names the field for an undecodable image or a count mismatch."""
        inputs = [self._decode(d, k, len(image_data)) for k, d in enumerate(image_data)]
        try:
            expanded = self.vision.expand(ids, inputs)
        except ValueError as e:
            raise InvalidRequest(f"image_data: {e}") from None
        images = tuple(self._serve(i) for i in inputs)
        out, k = list(expanded), 0
        for a, b in self.vision.runs(expanded):
            serial = images[k].serial
            out[a:b] = [image_key(serial, j) for j in range(b - a)]
            k += 1
        return tuple(out), images

    def _decode(self, item, k: int, n: int) -> ImageInputs:
        where = "image_data" + (f"[{k}]" if n > 1 else "")
        if not isinstance(item, str):
            raise InvalidRequest(f"{where}: expected a base64 string or a data: URL, got {type(item).__name__}")
        data = item.split(",", 1)[1] if item.startswith("data:") else item
        if item.startswith(("http://", "https://", "file:", "/")):
            raise InvalidRequest(f"{where}: the built-in engine takes images inline (base64 or a data: URL), "
                                 "not URLs or file paths")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"{where}: not valid base64; send the image file's bytes base64-encoded") from None
        try:
            return self.vision.process(raw, what=f"{where}: the image")
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    def _serve(self, inputs: ImageInputs) -> ServedImage:
        with self._lock:
            serial = self._serials.get(inputs.digest)
            if serial is None:
                serial = self._next
                self._next += 1
                self._serials[inputs.digest] = serial
                if len(self._serials) > MAX_SERIALS:  # a forgotten image gets a new serial: a miss, never a wrong hit
                    self._serials.popitem(last=False)
            else:
                self._serials.move_to_end(inputs.digest)
            image = self._live.get(serial)
            if image is None:
                offsets, advance = image_layout(inputs.grid, self.vision.merge)
                image = ServedImage(inputs, serial, offsets, advance)
                self._live[serial] = image
            return image

    # ---- prefill (scheduler thread, under model_lock) ---------------------------------------

    def inputs(self, prompts: list[tuple[int, ...]], cached: list[int], S: int, epoch: int, device):
        """For one prefill of right-aligned suffixes `prompts[i][cached[i]:]` in S columns: the input
        embeddings (R, S, hidden), the 3-D positions (3, R, S), each prompt's position offset (R,) and
        the suffixes' deepstack features (None for a model without them, or no image key computed)."""
        R = len(prompts)
        embed = self.model.get_input_embeddings()
        pos = torch.zeros((3, R, S), dtype=torch.long)
        deltas = torch.zeros(R, dtype=torch.long)
        ids = torch.full((R, S), 0, dtype=torch.long)
        for i, p in enumerate(prompts):
            full, deltas[i] = self.positions(p)
            n = len(p) - cached[i]
            pos[:, i, S - n:] = full[:, cached[i]:]
            ids[i, S - n:] = torch.tensor(p[cached[i]:])
        keys = ids < 0
        embeds = embed(ids.clamp(min=0).to(device))  # (R, S, H)
        deepstack = None
        if keys.any():
            parts = list(map(key_parts, ids[keys].tolist()))  # (serial, index) of each key, row-major
            table = self._image_embeddings({s for s, _ in parts}, epoch, device)
            mask = keys.to(device)
            embeds[mask] = torch.stack([table[s][0][j] for s, j in parts]).to(embeds.dtype)
            if table[parts[0][0]][1] is not None:
                deepstack = Deepstack(mask, torch.stack([table[s][1][:, j] for s, j in parts], dim=1).to(embeds.dtype))
        return embeds, pos.to(device), deltas.to(device), deepstack

    def offset(self, ids: tuple[int, ...]) -> int:
        """Next position minus length of a keyed sequence (0 without images)."""
        return self.positions(ids)[1] if any(t < 0 for t in ids) else 0

    def positions(self, ids: tuple[int, ...]) -> tuple[torch.Tensor, int]:
        """3-D positions (3, L) of a keyed sequence and its offset (next position - length); an image
        cut short at the end (a shared prefix ending inside it) keeps the positions of its first tokens."""
        L = len(ids)
        pos = torch.empty((3, L), dtype=torch.long)
        cur = i = 0
        while i < L:
            if not is_image_key(ids[i]):
                j = i
                while j < L and not is_image_key(ids[j]):
                    j += 1
                pos[:, i:j] = torch.arange(cur, cur + j - i)
                cur += j - i
                i = j
                continue
            image = self._image(key_parts(ids[i])[0])
            m = min(image.offsets.shape[1], L - i)
            pos[:, i:i + m] = image.offsets[:, :m] + cur
            cur += image.advance
            i += m
        return pos, cur - L

    def real_ids(self, ids) -> tuple[int, ...]:
        """The model's token ids of a keyed sequence: every image key as the image token."""
        return tuple(t if t >= 0 else self.image_token_id for t in ids)

    def _image(self, serial: int) -> ServedImage:
        image = self._live.get(serial)
        if image is None:  # only requests hold images, and only a held request's ids reach a prefill
            raise RuntimeError(f"image serial {serial} is not held by any request")
        return image

    def _image_embeddings(self, serials: set[int], epoch: int, device) -> dict:
        """Each image's vision-tower output (tokens, hidden) and deepstack features (layers, tokens,
        hidden) or None, computed once per weights epoch."""
        out, todo = {}, []
        for s in sorted(serials):
            hit = self._embeds.get(s)
            if hit is not None and hit[0] == epoch:
                out[s] = hit[1:]
                self._embeds.move_to_end(s)
            else:
                todo.append(self._image(s))
        if todo:
            pixels = torch.cat([im.inputs.pixel_values for im in todo]).to(device)
            grids = torch.tensor([im.inputs.grid for im in todo], device=device)
            tower = self.model.get_image_features(pixels, grids)
            feats = tower.pooler_output  # one (tokens, H) per image
            # Qwen3-VL: per deepstack layer, one (tokens, H) per image.
            layers = getattr(tower, "deepstack_features", None)
            for k, (im, f) in enumerate(zip(todo, feats)):
                deep = torch.stack([layer[k] for layer in layers]) if layers else None
                out[im.serial] = (f, deep)
                self._embeds[im.serial] = (epoch, f, deep)
            while len(self._embeds) > EMBED_CACHE:
                self._embeds.popitem(last=False)
        return out
