"""One image transform for training and evaluation, and the sample decoder of the stream.

``ImageTransform`` turns encoded image bytes (or an image file) into uint8 pixels (S, S, 3):
decode, optional augmentation (random resized crop, flips, 90 degree rotations), a bicubic
squash to S x S -- what `SiglipImageProcessor` does (resize to S x S, bicubic, in PIL), so a
published SigLIP checkpoint sees the pixels it was trained on. Evaluation is this transform with
augmentation off. Training takes a faster path (``fast``, on with ``data.jpeg_draft``): JPEGs at
least twice the size needed decode at a reduced DCT scale (PIL's draft rule; ~2x faster for
AID-sized tiles, pixels change slightly against a full decode), colour JPEGs decode through
simplejpeg (bit for bit PIL's decode), and the squash is torch's uint8 antialiased bicubic
(~7x faster than PIL's, within 2 grey levels of it). docs/guides/data.md ("JPEG decoding") gives the
measured differences and speeds; ``data.jpeg_draft=false`` takes PIL's path, making training
pixels bit-identical to evaluation's (tests/unit/test_transforms.py). Pixels leave as uint8, for
both: the model normalises them on the device (model.normalize_pixels); ``Normalize`` is its
numpy reference twin.
"""

from __future__ import annotations

import io
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

try:   # a dependency (setup.cfg); without it JPEGs decode through PIL: same pixels, slower
    import simplejpeg as _simplejpeg
except ImportError:
    _simplejpeg = None

from rsclip_ds.config import DataConfig
from rsclip_ds.data.bad import StreamCounter
from rsclip_ds.data.geotiff import BandChoice, is_tiff, to_rgb
from rsclip_ds.data.where import Where, json_columns

log = logging.getLogger("rsclip_ds.data")

JPEG_SOI = b"\xff\xd8\xff"


# What decoding a bad image raises (a truncated or non-image file, a bomb, a missing file): the
# training loader counts these as corrupt_image, evaluation as unreadable.
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def draft_scale(width: int, height: int, need: int) -> int:
    """PIL's ``Image.draft`` rule: the largest s in (8, 4, 2, 1) with both sides >= s * need."""
    fits = min(width // need, height // need)
    return next((s for s in (8, 4, 2) if fits >= s), 1)


def decode_jpeg_fast(data: bytes, need: int) -> np.ndarray | None:
    """A colour JPEG -> uint8 (H, W, 3) with simplejpeg (libjpeg-turbo, the same decoder PIL
    wraps, without PIL's per-image Python and its RGBX copy): bit for bit PIL's decode at PIL's
    draft scale for ``need``. None where PIL should decide: simplejpeg missing, not a JPEG, grey
    or CMYK, a header or stream simplejpeg rejects (TurboJPEG refuses some odd subsamplings and,
    strict, the recoverable errors PIL decodes through; PIL then decodes or raises as before, so
    what counts as a corrupt image does not change)."""
    if _simplejpeg is None or not data.startswith(JPEG_SOI):
        return None
    try:
        height, width, colorspace, _ = _simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in ("YCbCr", "RGB"):   # grey, CMYK/YCCK: PIL (its CMYK inversion, its L)
        return None
    if Image.MAX_IMAGE_PIXELS and width * height > 2 * Image.MAX_IMAGE_PIXELS:   # as Image.open
        raise Image.DecompressionBombError(f"Image size ({width * height} pixels) exceeds limit of "
                                           f"{2 * Image.MAX_IMAGE_PIXELS} pixels, could be decompression bomb DOS attack.")
    s = draft_scale(width, height, need)
    try:   # min_factor=s and the 1/s size: simplejpeg takes exactly 1/s, as PIL's draft does
        return _simplejpeg.decode_jpeg(data, "RGB", min_height=-(-height // s), min_width=-(-width // s),
                                       min_factor=s)
    except ValueError:
        return None


def resize_bicubic_fast(pixels: np.ndarray, size: int) -> np.ndarray:
    """uint8 (H, W, 3) -> uint8 (size, size, 3): torch's antialiased bicubic on uint8 (the AVX2
    kernel torchvision's Resize uses; ~7x faster than Pillow 13's on this CPU), within
    RESIZE_TOLERANCE of PIL's bicubic: the same filter (a = -0.5, support scaled when
    shrinking), integer weights of another precision, and always the horizontal pass first,
    where Pillow 13 runs the vertical pass first for some portrait images (H > W) that shrink
    (each pass rounds and clips to uint8, so the order shows on sharp edges). The output is
    written channels-last, so the (S, S, 3) array is contiguous without a transpose
    (F.interpolate returns NCHW, and the copy back costs as much as the resize): hence the
    aten op with ``out=`` (tested equal to F.interpolate in tests/unit/test_transforms.py)."""
    if not pixels.flags.writeable:   # torch.from_numpy warns on read-only arrays (np.asarray(PIL))
        pixels = pixels.copy()
    src = torch.from_numpy(pixels).permute(2, 0, 1)[None]                          # (1, 3, H, W)
    out = torch.empty((1, size, size, 3), dtype=torch.uint8)                      # (1, S, S, 3)
    torch.ops.aten._upsample_bicubic2d_aa.out(src, [size, size], False, None, None, out=out.permute(0, 3, 1, 2))
    return out[0].numpy()


def two_views(pixels: np.ndarray, size: int, teacher_size: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 (M, M, 3) at M = max(size, teacher_size) -> (student (S, S, 3), teacher (T, T, 3)):
    a distillation teacher sees the student's crop and flips. The transform runs once, at the
    larger size; the model at that size gets its pixels unchanged, the other one a resize of them
    (resize_bicubic_fast: 256 -> 224 for a Git-RSCLIP-large teacher of a base student)."""
    def at(n: int) -> np.ndarray:
        return pixels if pixels.shape[0] == n else resize_bicubic_fast(np.ascontiguousarray(pixels), n)

    return at(size), at(teacher_size)


# Grey levels (0-255) between resize_bicubic_fast and PIL's bicubic of the same pixels, measured on
# synthetic scenes and uniform noise (the worst case), shrinking and enlarging; held by
# tests/unit/test_transforms.py. "portrait": H > W, where Pillow may run the passes the other way
# (synthetic scenes: max 8-10, mean 0.15-0.18; 0.03% of values off by more than 2).
RESIZE_TOLERANCE = {"max": 2, "mean": 0.02}
RESIZE_TOLERANCE_PORTRAIT = {"max": 24, "mean": 0.5}


@dataclass(frozen=True)
class ImageTransform:
    """Encoded image -> uint8 (S, S, 3) pixels; ``rng`` draws the augmentation (unused when off).

    ``fast`` (training, ``data.jpeg_draft``): JPEGs are decoded at PIL's draft scale (by
    simplejpeg where installed: same pixels as PIL's draft, faster) and the squash is torch's
    uint8 bicubic (within RESIZE_TOLERANCE of PIL's). Off (evaluation): PIL's full decode and
    bicubic, the pixels of transformers' SigLIP processor. A random resized crop takes PIL's
    path either way (its box resize reads pixels around the box), with the draft scale when fast."""

    size: int
    crop: tuple[float, float] | None = None    # random resized crop, area fraction range
    hflip: bool = False
    vflip: bool = False
    rot90: bool = False
    fast: bool = False                          # draft-scale JPEG decode, torch resize
    bands: BandChoice | None = None             # multispectral TIFFs -> RGB (geotiff.py)

    @classmethod
    def from_config(cls, size: int, cfg: DataConfig | None = None,
                    bands: BandChoice | None = None) -> "ImageTransform":
        """Training's transform from the data config; ``cfg=None`` is the evaluation transform
        (no augmentation, full decode: as transformers' SigLIP image processor), with ``bands``
        for multispectral TIFFs (eval.bands)."""
        if cfg is None:
            return cls(size, bands=bands)
        if cfg.jpeg_draft and _simplejpeg is None:
            log.warning("simplejpeg is not installed (a dependency of rsclip_ds): training decodes JPEGs with "
                        "PIL, same pixels, 1.3-2x the time per image (docs/results/data.md#decode). "
                        "pip install 'simplejpeg>=1.9.0,<1.10'")
        return cls(size, crop=cfg.random_resized_crop, hflip=cfg.hflip, vflip=cfg.vflip, rot90=cfg.rot90,
                   fast=cfg.jpeg_draft)

    def __call__(self, source: bytes | str | Path, rng: random.Random | None = None) -> np.ndarray:
        rng = rng or random.Random(0)
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        if self.fast and self.crop is None:
            pixels = self._fast(data)
        else:
            pixels = self._pil(data, rng)
        if self.hflip and rng.random() < 0.5:
            pixels = pixels[:, ::-1]                 # PIL's FLIP_LEFT_RIGHT
        if self.vflip and rng.random() < 0.5:
            pixels = pixels[::-1]                    # FLIP_TOP_BOTTOM
        if self.rot90:
            turn = rng.randrange(4)
            pixels = np.rot90(pixels, turn)          # counter-clockwise: PIL's ROTATE_90/180/270
        return np.ascontiguousarray(pixels)          # (S, S, 3)

    def _fast(self, data: bytes) -> np.ndarray:
        pixels = decode_jpeg_fast(data, self.size)
        if pixels is None:
            pixels = np.array(self._open(data, draft=True))     # writable: torch.from_numpy takes it
        if pixels.shape[:2] != (self.size, self.size):
            pixels = resize_bicubic_fast(pixels, self.size)
        return pixels

    def _open(self, data: bytes, draft: bool, need: int | None = None) -> Image.Image:
        """PIL's decode to RGB; draft: at the smallest 1/2^k JPEG scale still >= ``need``. TIFFs
        with a band choice, and those PIL cannot open (16-bit, > 3 bands), go through geotiff.py:
        a multi-band one without ``bands`` raises BandsError, naming --bands."""
        if is_tiff(data) and self.bands is not None:
            return Image.fromarray(to_rgb(data, self.bands))
        try:
            img = Image.open(io.BytesIO(data))
        except IMAGE_ERRORS:
            if is_tiff(data):
                return Image.fromarray(to_rgb(data, None))   # raises BandsError, or a clear OSError
            raise
        if is_tiff(data) and img.mode.startswith(("I", "F")):   # 16/32-bit: PIL's RGB would be garbage
            return Image.fromarray(to_rgb(data, None))
        if draft:
            img.draft("RGB", (need or self.size,) * 2)
        img.load()                 # decodes: a corrupt file raises here
        if img.mode != "RGB":      # (JPEG drafts decode straight to RGB: no copy then)
            img = img.convert("RGB")
        return img

    def _pil(self, data: bytes, rng: random.Random) -> np.ndarray:
        """PIL end to end: decode (draft when fast), random crop box, bicubic squash."""
        need = self.size if self.crop is None else int(np.ceil(self.size / np.sqrt(self.crop[0])))
        img = self._open(data, self.fast, need)
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
        return np.asarray(img, dtype=np.uint8)


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
    """Raw sample bytes -> (uint8 (S, S, 3) pixels, caption, key) or None (counted as bad);
    with ``views`` = (S, T) a distillation teacher's (T, T, 3) pixels of the same view follow."""

    transform: ImageTransform
    image_keys: list[str]
    caption_keys: list[str]
    where: Where | None = None     # data.where over the sample's JSON member (where.py)
    views: tuple[int, int] | None = None   # (student, teacher) sizes; transform.size is the larger

    def keep(self, sample: dict, counter: StreamCounter) -> bool:
        """data.where: False (counted as filtered_out, no example logged) when the sample's JSON
        fails it; a sample without JSON has no columns, so every comparison is false."""
        if self.where is None:
            return True
        if self.where(json_columns(sample.get("json"))):
            counter.filtered_run = 0
            return True
        counter.bad["filtered_out"] += 1
        counter.filtered_run += 1
        return False

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
        if not self.keep(sample, counter):
            return None
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
        except IMAGE_ERRORS as err:
            counter.report("corrupt_image", where, f"{type(err).__name__}: {err}")
            return None
        if self.views is not None:   # distillation: both models' pixels of one view (two_views)
            student, teacher = two_views(pixels, *self.views)
            return student, caption, sample["__key__"], teacher
        return pixels, caption, sample["__key__"]
