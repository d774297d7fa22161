"""Synthetic shards: deterministic pixels and tars, captions that describe the labels."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from rsclip_ds.data import expand_urls
from rsclip_ds.data.synthetic import LAND_COVER_CLASSES, make_synthetic, render_sample, sample_rng


def _digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _members(tar_path) -> dict[str, bytes]:
    with tarfile.open(tar_path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_render_is_deterministic_and_caption_describes_labels():
    for index in range(40):
        img_a, cap_a, lab_a = render_sample(np.random.default_rng(index), size=48)
        img_b, cap_b, lab_b = render_sample(np.random.default_rng(index), size=48)
        assert np.array_equal(np.asarray(img_a), np.asarray(img_b)) and (cap_a, lab_a) == (cap_b, lab_b)
        assert img_a.size == (48, 48) and img_a.mode == "RGB"
        assert lab_a["land_cover"] in LAND_COVER_CLASSES
        assert LAND_COVER_CLASSES[lab_a["land_cover_id"]] == lab_a["land_cover"]
        assert lab_a["land_cover"] in cap_a
        assert 1 <= len(lab_a["objects"]) <= 2
        for obj in lab_a["objects"]:
            assert f"{obj['color']} {obj['shape']}" in cap_a and f"in the {obj['position']}" in cap_a


def test_render_varies_with_the_rng():
    captions = {render_sample(np.random.default_rng(i), 32)[1] for i in range(50)}
    classes = {render_sample(np.random.default_rng(i), 32)[2]["land_cover"] for i in range(200)}
    assert len(captions) > 40
    assert classes == set(LAND_COVER_CLASSES)


def test_same_seed_gives_byte_identical_shards(tmp_path):
    kw = dict(num_train=20, num_val=6, shard_size=8, image_size=24, progress=False)
    make_synthetic(tmp_path / "a", seed=3, **kw)
    make_synthetic(tmp_path / "b", seed=3, **kw)
    make_synthetic(tmp_path / "c", seed=4, **kw)
    a, b, c = _digest(tmp_path / "a"), _digest(tmp_path / "b"), _digest(tmp_path / "c")
    assert a == b
    assert sorted(a) == ["index.json", "train-000000.tar", "train-000001.tar", "train-000002.tar",
                         "val-000000.tar"]
    assert all(a[name] != c[name] for name in a if name.endswith(".tar"))


def test_samples_do_not_depend_on_shard_size(tmp_path):
    kw = dict(num_train=12, num_val=2, image_size=24, seed=1, progress=False)
    make_synthetic(tmp_path / "small", shard_size=5, **kw)
    make_synthetic(tmp_path / "big", shard_size=12, **kw)
    small = {}
    for name in ("train-000000.tar", "train-000001.tar", "train-000002.tar"):
        small.update(_members(tmp_path / "small" / name))
    assert small == _members(tmp_path / "big" / "train-000000.tar")


def test_index_matches_tar_contents(tiny_shards):
    folder = tiny_shards["dir"]
    on_disk = json.loads((folder / "index.json").read_text())
    assert {k: on_disk[k] for k in ("train", "val", "seed", "image_size")} == \
        {k: tiny_shards[k] for k in ("train", "val", "seed", "image_size")}
    assert [s["num_samples"] for s in on_disk["train"]] == [8] * 8
    assert [s["num_samples"] for s in on_disk["val"]] == [8, 8]
    for split in ("train", "val"):
        for shard in on_disk[split]:
            members = _members(folder / shard["url"])
            keys = {name.split(".", 1)[0] for name in members}
            assert len(keys) == shard["num_samples"] and len(members) == 3 * len(keys)
            assert all("." not in key for key in keys)
    urls = expand_urls(tiny_shards["train_pattern"])
    assert [u.rsplit("/", 1)[1] for u in urls] == [s["url"] for s in on_disk["train"]]


def test_tar_members_decode_and_agree(tiny_shards):
    members = _members(tiny_shards["dir"] / "val-000001.tar")
    for key in sorted({name.split(".", 1)[0] for name in members}):
        labels = json.loads(members[f"{key}.json"])
        caption = members[f"{key}.txt"].decode()
        image = Image.open(io.BytesIO(members[f"{key}.jpg"]))
        assert image.format == "JPEG" and image.size == (32, 32)
        assert labels["land_cover"] in caption
        index = int(key.split("_")[1])
        _, expected_caption, expected_labels = render_sample(sample_rng(0, "val", index), 32)
        assert (caption, labels) == (expected_caption, expected_labels)


def test_make_synthetic_rejects_empty_splits(tmp_path):
    with pytest.raises(ValueError, match="num_train"):
        make_synthetic(tmp_path, num_train=0, progress=False)
