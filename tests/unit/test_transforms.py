"""One image transform: the training loader (augmentation and JPEG draft decoding off) and
evaluation give the same pixels for the same image, bit for bit, for JPEG, PNG and a grey-scale
image; with draft decoding on (the training default) only JPEGs at least twice the input size
change, by a measured amount."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from webdataset import TarWriter

from rsclip_ds.config import DataConfig
from rsclip_ds.data import ImageTransform, Normalize, build_train_loader
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


def test_draft_decoding_changes_only_large_jpegs(images, tiny_tokenizer):
    """With the training default (draft on) the two 130 x 90 JPEGs (colour and grey, for 24 px)
    decode at 1/2 scale and change by a few grey levels on average; the PNG is untouched."""
    root, encoded = images
    train = _training_pixels(root, encoded, tiny_tokenizer)
    evaluated = _evaluation_pixels(root, encoded, tiny_tokenizer)
    assert torch.equal(train["png"], evaluated["png"])
    for key in ("jpeg", "grey"):
        grey_levels = (train[key].float() - evaluated[key].float()).abs()          # uint8 pixels: 0..255
        assert 0 < grey_levels.mean() < 8, (key, grey_levels.mean())


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
