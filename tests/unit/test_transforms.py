"""One image transform: the training loader (augmentation and the fast path off) and evaluation
give the same pixels for the same image, bit for bit, for JPEG, PNG and a grey-scale image; with
the fast path on (the training default) pixels stay within measured tolerances: simplejpeg
decodes as PIL does bit for bit, torch's uint8 bicubic is within 2 grey levels of PIL's, and
only JPEGs at least twice the input size (draft scale) change more. What PIL must decode (PNG,
grey, CMYK, odd JPEGs, no simplejpeg) goes through PIL; corrupt JPEGs still count as
corrupt_image."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import random
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from webdataset import TarWriter

from rsclip_ds.config import DataConfig
from rsclip_ds.data import ImageTransform, Normalize, build_train_loader
from rsclip_ds.data import SampleDecoder, StreamCounter, transforms
from rsclip_ds.data.transforms import RESIZE_TOLERANCE, RESIZE_TOLERANCE_PORTRAIT
from rsclip_ds.evaluation.embed import Embedder
from rsclip_ds.model import ModelBundle

SIZE = 24
MEAN, STD = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)   # not 0.5: a swapped mean/std would show


def _images() -> dict[str, tuple[str, bytes]]:
    """key -> (extension, encoded bytes): larger than SIZE and not square, so the JPEG draft
    scale, the squash and the bicubic resize all take part."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:90, 0:130]
    smooth = np.stack([(xx * 2) % 256, (yy * 3) % 256, (xx + yy) % 256], -1).astype(np.uint8)
    noisy = rng.integers(0, 256, (70, 50, 3), dtype=np.uint8)
    out = {}
    for key, arr, fmt, mode in (("jpeg", smooth, "JPEG", "RGB"), ("png", noisy, "PNG", "RGB"),
                                ("grey", smooth[..., 0], "JPEG", "L")):
        buf = io.BytesIO()
        Image.fromarray(arr, mode).save(buf, fmt, quality=90)
        out[key] = ("jpg" if fmt == "JPEG" else "png", buf.getvalue())
    return out


class _Recorder:
    """Stands in for the model: records the pixels evaluation feeds it, returns unit embeddings."""

    def __init__(self):
        self.pixels = []

    def __call__(self, pixel_values, input_ids):
        self.pixels.append(pixel_values.clone())
        one = torch.nn.functional.normalize(torch.ones(len(pixel_values), 4), dim=-1)
        return one, torch.nn.functional.normalize(torch.ones(len(input_ids), 4), dim=-1), None, None


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """The images as files (what evaluation reads) and as one webdataset shard (what training reads)."""
    root = tmp_path_factory.mktemp("transforms")
    encoded = _images()
    with TarWriter(str(root / "train-000000.tar"), encoder=False, mtime=0) as sink:
        for key, (ext, data) in encoded.items():
            (root / f"{key}.{ext}").write_bytes(data)
            sink.write({"__key__": key, ext: data, "txt": f"an image called {key}".encode()})
    (root / "index.json").write_text(json.dumps({"train": [{"url": "train-000000.tar", "num_samples": 3}]}))
    return root, encoded


def _training_pixels(root, encoded, tokenizer, **data) -> dict:
    loader = build_train_loader(DataConfig(train_shards=str(root / "train-000000.tar"), num_workers=0,
                                           shuffle_buffer=0, **data),
                                tokenizer=tokenizer, image_size=SIZE, max_text_length=16, micro_batch_size=1,
                                rank=0, world_size=1, seed=0, return_keys=True)
    batches = iter(loader)
    train = {}
    for _ in encoded:
        batch = next(batches)
        train[batch["keys"][0]] = batch["pixel_values"][0]                   # (3, S, S)
    return train


def _evaluation_pixels(root, encoded, tokenizer) -> dict:
    bundle = ModelBundle(None, tokenizer, SIZE, MEAN, STD, 16)
    recorder = _Recorder()
    keys = sorted(encoded)
    Embedder(recorder, bundle, batch_size=len(keys), progress=False).embed(
        [root / f"{k}.{encoded[k][0]}" for k in keys], ["a caption"], "test")
    return dict(zip(keys, recorder.pixels[0]))


def test_training_and_evaluation_give_the_same_pixels(images, tiny_tokenizer):
    root, encoded = images
    train = _training_pixels(root, encoded, tiny_tokenizer, jpeg_draft=False)
    evaluated = _evaluation_pixels(root, encoded, tiny_tokenizer)
    assert sorted(train) == sorted(evaluated) == sorted(encoded)
    for key in encoded:
        assert train[key].shape == (3, SIZE, SIZE)
        assert torch.equal(train[key], evaluated[key]), key


def test_fast_path_changes_pixels_within_tolerance(images, tiny_tokenizer):
    """With the training default (fast) the two 130 x 90 JPEGs (colour and grey, for 24 px)
    decode at 1/2 scale and change by a few grey levels on average; the PNG only meets the
    resize's difference (PIL decodes it as before)."""
    root, encoded = images
    train = _training_pixels(root, encoded, tiny_tokenizer)
    evaluated = _evaluation_pixels(root, encoded, tiny_tokenizer)
    grey_levels = {k: (train[k].float() - evaluated[k].float()).abs() for k in encoded}   # uint8 pixels: 0..255
    assert grey_levels["png"].max() <= RESIZE_TOLERANCE["max"]
    assert grey_levels["png"].mean() < RESIZE_TOLERANCE["mean"]
    for key in ("jpeg", "grey"):
        assert 0 < grey_levels[key].mean() < 8, (key, grey_levels[key].mean())


def test_normalize_is_the_model_normalisation():
    pixels = np.random.default_rng(1).integers(0, 256, (2, 5, 5, 3), dtype=np.uint8)
    want = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) \
        / torch.tensor(STD).view(1, 3, 1, 1)
    got = torch.from_numpy(Normalize(MEAN, STD)(pixels))
    assert got.shape == (2, 3, 5, 5)
    assert torch.allclose(got, want, atol=1e-6)


def test_evaluation_transform_has_no_augmentation():
    assert ImageTransform.from_config(SIZE) == ImageTransform(SIZE)
    flips = DataConfig(hflip=True, vflip=True, rot90=True, random_resized_crop=(0.5, 1.0))
    train = ImageTransform.from_config(SIZE, flips)
    assert (train.hflip, train.vflip, train.rot90, train.crop) == (True, True, True, (0.5, 1.0))


# --------------------------------------------------------------------------- the fast path's parts

def _jpeg(arr: np.ndarray, mode: str | None = None, **save) -> bytes:
    buf = io.BytesIO()
    image = Image.fromarray(arr)
    (image.convert(mode) if mode else image).save(buf, "JPEG", **{"quality": 90, **save})
    return buf.getvalue()


def _scene(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus noise: both the colour-upsampling and the high-frequency paths work."""
    yy, xx = np.mgrid[0:h, 0:w]
    smooth = np.stack([(xx * 3) % 256, (yy * 2) % 256, (xx + 2 * yy) % 256], -1)
    noise = np.random.default_rng(seed).integers(-40, 40, (h, w, 3))
    return np.clip(smooth + noise, 0, 255).astype(np.uint8)


def _pil_decode(data: bytes, need: int | None) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    if need:
        img.draft("RGB", (need, need))
    return np.asarray(img.convert("RGB"))


@pytest.mark.skipif(transforms._simplejpeg is None, reason="simplejpeg is not installed")
@pytest.mark.parametrize("save", [{}, {"subsampling": 0}, {"subsampling": 1}, {"progressive": True},
                                  {"keep_rgb": True}, {"quality": 60}], ids=str)
def test_simplejpeg_decodes_as_pil_at_the_draft_scale(save):
    """Same libjpeg-turbo decode: bit for bit PIL's, at full size and at PIL's draft scale (odd
    sizes: 1/s rounds up the same way)."""
    for h, w in ((90, 130), (301, 517), (613, 600)):
        data = _jpeg(_scene(h, w), **save)
        for need in (24, 64, 150, 256, 1000):
            got = transforms.decode_jpeg_fast(data, need)
            want = _pil_decode(data, need)
            assert got is not None and got.shape == want.shape, (h, w, need, got.shape, want.shape)
            assert np.array_equal(got, want), (h, w, need, save)
            assert got.flags.writeable


@pytest.mark.parametrize("shape, size", [((256, 256), 224), ((600, 600), 256), ((300, 300), 256),
                                         ((64, 64), 224), ((90, 130), 24), ((257, 333), 256), ((100, 60), 224),
                                         ((333, 257), 256), ((300, 200), 224), ((600, 450), 256)])
def test_fast_resize_is_pil_bicubic_within_tolerance(shape, size):
    """Shrinking (antialiased) and enlarging, square, landscape and portrait; noise is the hard
    case. The private aten op (written channels-last) equals F.interpolate, the public API, bit
    for bit."""
    h, w = shape
    tolerance = RESIZE_TOLERANCE_PORTRAIT if h > w else RESIZE_TOLERANCE
    for pixels in (_scene(*shape), np.random.default_rng(1).integers(0, 256, (*shape, 3), dtype=np.uint8)):
        got = transforms.resize_bicubic_fast(pixels, size)
        want = np.asarray(Image.fromarray(pixels).resize((size, size), Image.Resampling.BICUBIC))
        diff = np.abs(got.astype(int) - want)
        assert got.shape == (size, size, 3) and got.flags.c_contiguous
        assert diff.max() <= tolerance["max"] and diff.mean() < tolerance["mean"], (diff.max(), diff.mean())
        public = torch.nn.functional.interpolate(torch.from_numpy(pixels).permute(2, 0, 1)[None], size=(size, size),
                                                 mode="bicubic", antialias=True)[0].permute(1, 2, 0)
        assert torch.equal(torch.from_numpy(got), public)


@pytest.mark.parametrize("kind", ["png", "grey", "cmyk", "rgb-coded"])
def test_what_simplejpeg_does_not_take_goes_through_pil(kind):
    """PNG, grey and CMYK JPEGs: PIL decodes (its L -> RGB, its Adobe CMYK inversion, the draft
    scale), then the fast resize: within the resize tolerance of PIL's path at the same scale.
    A JPEG coded in RGB (no YCbCr) is simplejpeg's and decodes as PIL's too."""
    arr = _scene(90, 130)
    data = {"png": _encode_png(arr), "grey": _jpeg(arr[..., 0]), "cmyk": _jpeg(arr, "CMYK"),
            "rgb-coded": _jpeg(arr, keep_rgb=True)}[kind]
    got = ImageTransform(40, fast=True)(data)
    old = np.asarray(Image.fromarray(_pil_decode(data, 40)).resize((40, 40), Image.Resampling.BICUBIC))
    assert (transforms.decode_jpeg_fast(data, 40) is None) == (kind != "rgb-coded")
    assert np.array_equal(got, transforms.resize_bicubic_fast(_pil_decode(data, 40), 40))
    diff = np.abs(got.astype(int) - old)
    assert diff.max() <= RESIZE_TOLERANCE["max"] and diff.mean() < RESIZE_TOLERANCE["mean"], (kind, diff.max())


def _encode_png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def test_without_simplejpeg_pil_decodes_the_same_pixels(monkeypatch, caplog):
    """A copy of the module imported with `import simplejpeg` failing: the same pixels (PIL's
    decode is simplejpeg's), and the training transform says what to install."""
    monkeypatch.setitem(sys.modules, "simplejpeg", None)         # import simplejpeg -> ImportError
    spec = importlib.util.spec_from_file_location("transforms_without_simplejpeg", transforms.__file__)
    bare = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bare)
    spec.loader.exec_module(bare)
    assert bare._simplejpeg is None
    with caplog.at_level(logging.WARNING, logger="rsclip_ds.data"):
        train = bare.ImageTransform.from_config(56, DataConfig())
    assert train.fast and "pip install 'simplejpeg" in caplog.text
    for h, w in ((90, 130), (300, 300)):          # full size and 1/2 draft scale
        data = _jpeg(_scene(h, w))
        assert bare.decode_jpeg_fast(data, 56) is None
        assert np.array_equal(train(data), ImageTransform(56, fast=True)(data))


def _bad_jpegs() -> dict[str, bytes]:
    good = _jpeg(_scene(120, 160))
    sos = good.index(b"\xff\xda")
    return {"truncated": good[: int(len(good) * 0.7)],
            "garbage after SOI": b"\xff\xd8\xff" + bytes(range(256)) * 4,
            "header only": good[:sos],
            "no SOF": good[:2] + good[sos:]}


@pytest.mark.parametrize("name", list(_bad_jpegs()))
def test_a_corrupt_jpeg_still_counts_as_corrupt_image(name):
    """The fast path rejects what PIL rejects, with an exception SampleDecoder counts."""
    data = _bad_jpegs()[name]
    with pytest.raises((OSError, ValueError, SyntaxError)):
        ImageTransform(32)(data)                       # PIL: the reference
    counter = StreamCounter({})
    prep = SampleDecoder(ImageTransform(32, fast=True), ["jpg"], ["txt"])
    sample = {"__key__": "k", "__url__": "shard.tar", "jpg": data, "txt": b"a caption"}
    assert prep(sample, random.Random(0), counter) is None
    assert counter.bad["corrupt_image"] == 1


def test_recoverable_jpeg_errors_decode_as_pil_does():
    """Junk bytes before the end marker: libjpeg warns, PIL decodes; strict simplejpeg refuses,
    so the fast path hands it to PIL and decodes it too."""
    good = _jpeg(_scene(120, 160))
    data = good[:-2] + b"\x00\x00\x00" + good[-2:]
    if transforms._simplejpeg is not None:
        with pytest.raises(ValueError, match="extraneous bytes"):
            transforms._simplejpeg.decode_jpeg(data, "RGB")
        assert transforms.decode_jpeg_fast(data, 60) is None
    assert np.array_equal(ImageTransform(60, fast=True)(data), ImageTransform(60, fast=True)(good))


def test_a_decompression_bomb_is_refused_before_decoding(monkeypatch):
    data = _jpeg(_scene(120, 160))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 120 * 160 // 3)
    for transform in (ImageTransform(32), ImageTransform(32, fast=True)):
        with pytest.raises(Image.DecompressionBombError):
            transform(data)


def test_fast_flips_and_rotations_are_exact_transforms():
    """Flips and rotations act on the resized array; the same draws as PIL's path give the same
    geometry (test_data_features.py checks PIL's path)."""
    data = _jpeg(_scene(300, 300))
    base = ImageTransform(48, fast=True)(data, random.Random(0))
    seen = set()
    for seed in range(30):
        out = ImageTransform(48, hflip=True, vflip=True, rot90=True, fast=True)(data, random.Random(seed))
        slow = ImageTransform(48, hflip=True, vflip=True, rot90=True)(data, random.Random(seed))
        rng = random.Random(seed)
        want = base[:, ::-1] if rng.random() < 0.5 else base
        want = want[::-1] if rng.random() < 0.5 else want
        turn = rng.randrange(4)
        assert np.array_equal(out, np.rot90(want, turn)) and out.flags.c_contiguous
        assert np.abs(out.astype(int) - slow).mean() < 8      # same geometry as PIL's path
        seen.add(turn)
    assert seen == {0, 1, 2, 3}
