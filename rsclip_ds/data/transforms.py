"""One image transform for training and evaluation, and the sample decoder of the stream.

``ImageTransform`` turns encoded image bytes (or an image file) into uint8 pixels (S, S, 3):
decode, optional augmentation (random resized crop, flips, 90 degree rotations), a bicubic
squash to S x S -- what `SiglipImageProcessor` does (resize to S x S, bicubic, in PIL), so a
published SigLIP checkpoint sees the pixels it was trained on. Evaluation is this transform with
augmentation off. Training also decodes large JPEGs at a reduced DCT scale (``draft``: ~2x faster
decoding, taken only when the image is at least twice the size needed); that changes pixels
slightly against a full decode (docs/data.md gives the measured size), and
``data.jpeg_draft=false`` turns it off, making training pixels bit-identical to evaluation's
(tests/unit/test_transforms.py). Pixels leave as uint8, for both: the model normalises them on
the device (model.normalize_pixels); ``Normalize`` is its numpy reference twin.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from rsclip_ds.config import DataConfig
from rsclip_ds.data.bad import StreamCounter


@dataclass(frozen=True)
class ImageTransform:
    """Encoded image -> uint8 (S, S, 3) pixels; ``rng`` draws the augmentation (unused when off)."""

    size: int
    crop: tuple[float, float] | None = None    # random resized crop, area fraction range
    hflip: bool = False
    vflip: bool = False
    rot90: bool = False
    draft: bool = False                          # JPEG: decode at 1/2^k scale when large enough

    @classmethod
    def from_config(cls, size: int, cfg: DataConfig | None = None) -> "ImageTransform":
        """Training's transform from the data config; ``cfg=None`` is the evaluation transform
        (no augmentation, full decode: as transformers' SigLIP image processor)."""
        if cfg is None:
            return cls(size)
        return cls(size, crop=cfg.random_resized_crop, hflip=cfg.hflip, vflip=cfg.vflip, rot90=cfg.rot90,
                   draft=cfg.jpeg_draft)

    def __call__(self, source: bytes | str | Path, rng: random.Random | None = None) -> np.ndarray:
        rng = rng or random.Random(0)
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        img = Image.open(io.BytesIO(data))
        if self.draft:   # JPEG: decode at the smallest 1/2^k scale still >= what the crop needs
            need = self.size if self.crop is None else int(np.ceil(self.size / np.sqrt(self.crop[0])))
            img.draft("RGB", (need, need))
        img.load()                 # decodes: a corrupt file raises here
        if img.mode != "RGB":      # (JPEG drafts decode straight to RGB: no copy then)
            img = img.convert("RGB")
        box = None
        if self.crop is not None:
            w, h = img.size
            area = w * h * rng.uniform(*self.crop)
            aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
            cw = min(w, max(1, round(np.sqrt(area * aspect))))
            ch = min(h, max(1, round(np.sqrt(area / aspect))))
            x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
            box = (x0, y0, x0 + cw, y0 + ch)
        if box is not None or img.size != (self.size, self.size):
            img = img.resize((self.size, self.size), Image.Resampling.BICUBIC, box=box)  # squash
        if self.hflip and rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if self.vflip and rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        if self.rot90:
            turn = rng.randrange(4)
            if turn:
                img = img.transpose([Image.Transpose.ROTATE_90, Image.Transpose.ROTATE_180,
                                     Image.Transpose.ROTATE_270][turn - 1])
        return np.asarray(img, dtype=np.uint8)   # (S, S, 3)


class Normalize:
    """uint8 pixels (B, S, S, 3) -> float32 (B, 3, S, S), ``(x / 255 - mean) / std``, written
    into ``out`` when given. The reference twin of ``model.normalize_pixels`` (what the loader
    ran on the CPU before batches went uint8): the tests hold the device path to its numbers,
    bit for bit."""

    def __init__(self, mean, std):
        std = np.asarray(std, np.float32).reshape(1, 3, 1, 1)
        self.scale = (1.0 / (255.0 * std)).astype(np.float32)
        self.shift = (-np.asarray(mean, np.float32).reshape(1, 3, 1, 1) / std).astype(np.float32)

    def __call__(self, pixels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        pixels = np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))              # (B, 3, S, S)
        if out is None:
            out = np.empty(pixels.shape, np.float32)
        np.multiply(pixels, self.scale, out=out, casting="unsafe")
        out += self.shift
        return out


@dataclass
class SampleDecoder:
    """Raw sample bytes -> (uint8 (S, S, 3) pixels, caption, key) or None (counted as bad)."""

    transform: ImageTransform
    image_keys: list[str]
    caption_keys: list[str]

    def captions(self, sample: dict) -> list[str]:
        key = next((k for k in self.caption_keys if k in sample), None)
        if key is None:
            return []
        text = sample[key].decode("utf-8", errors="replace")
        if key.endswith("json"):
            obj = json.loads(text)
            caps = obj.get("captions") or ([obj["caption"]] if obj.get("caption") else [])
            return [c.strip() for c in caps if c and c.strip()]
        return [line.strip() for line in text.splitlines() if line.strip()]

    def __call__(self, sample: dict, rng: random.Random, counter: StreamCounter) -> tuple | None:
        where = f"{sample['__url__']}:{sample['__key__']}"
        key = next((k for k in self.image_keys if k in sample), None)
        if key is None:
            members = sorted(k for k in sample if not k.startswith("__"))
            counter.report("missing_image", where, f"members {members}; data.image_key is "
                           f"{';'.join(self.image_keys)}")
            return None
        try:
            captions = self.captions(sample)
        except (ValueError, AttributeError) as err:
            captions, detail = [], f"unreadable caption: {err}"
        else:
            detail = (f"members {sorted(k for k in sample if not k.startswith('__'))}; "
                      f"data.caption_key is {';'.join(self.caption_keys)}")
        if not captions:
            counter.report("missing_caption", where, detail)
            return None
        caption = captions[rng.randrange(len(captions))] if len(captions) > 1 else captions[0]
        try:
            pixels = self.transform(sample[key], rng)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
            counter.report("corrupt_image", where, f"{type(err).__name__}: {err}")
            return None
        return pixels, caption, sample["__key__"]
