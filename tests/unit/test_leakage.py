"""Train/test leakage (rsclip_ds/data/near_duplicates.py, rsclip_ds/evaluation/leakage.py): the
index against brute force, planted near-duplicates found by `check-leakage` with the right
shards, keys, sets and paths, distinct look-alike scenes not, cross-set duplicates among the
evaluation sets, the exit codes, and `make-shards --exclude-near` dropping exactly the planted
images (folder input and a Git-10M-shaped parquet). All in this process, the CLI through main().

The pictures are synthetic scenes (rsclip_ds/data/synthetic.py: land-cover textures with shapes),
160 px: the same classes look alike, which is what the fine hash has to tell apart."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image, ImageEnhance
from webdataset import TarWriter

from rsclip_ds.cli import main
from rsclip_ds.data.near_duplicates import HashIndex, band_layout, brute_force_pairs
from rsclip_ds.data.synthetic import class_folder_name, render_sample
from tests.corpora import git10m_rows, write_git10m

SIZE = 160


def scene(i: int) -> tuple[Image.Image, str]:
    image, _, labels = render_sample(np.random.default_rng([77, i]), SIZE)
    return image, class_folder_name(labels["land_cover"])


def encode(image: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


# the planted copies: (evaluation scene, what was done to it, member extension)
VARIANTS = {
    "resized": (2, lambda im: encode(im.resize((128, 128), Image.Resampling.BICUBIC), quality=90), "jpg"),
    "jpeg_q25": (3, lambda im: encode(im, quality=25), "jpg"),
    "png_copy": (14, lambda im: encode(im, "PNG"), "png"),
    "brighter": (21, lambda im: encode(ImageEnhance.Brightness(im).enhance(1.04), quality=90), "jpg"),
    "copy_of_0": (0, lambda im: encode(im, quality=80), "jpg"),
}
DISTINCT = range(30, 54)     # other scenes of the same eight classes


def _cli(capsys, *args: str) -> SimpleNamespace:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> SimpleNamespace:
    """suite/AID/<Class>/ (scenes 0-11), suite/UCMerced/Images/<Class>/ (12-19), and an RSICD-style
    caption JSON rsicd/dataset_rsicd.json + rsicd/images/ (20-23 and a re-encoded copy of scene 0:
    a cross-set duplicate)."""
    root = tmp_path_factory.mktemp("leakage")
    paths = {}
    for i in range(20):
        image, folder = scene(i)
        where = root / "suite" / ("AID" if i < 12 else "UCMerced/Images") / folder / f"scene_{i}.jpg"
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_bytes(encode(image, quality=95))
        paths[i] = where
    (root / "rsicd" / "images").mkdir(parents=True)
    entries = []
    for i in (20, 21, 22, 23, "0b"):
        image = scene(0 if i == "0b" else i)[0]
        paths[i] = root / "rsicd" / "images" / f"rs_{i}.png"
        paths[i].write_bytes(encode(image, "PNG"))
        entries.append({"filename": f"rs_{i}.png", "split": "test", "sentences": [{"raw": "a scene"}]})
    caption_json = root / "rsicd" / "dataset_rsicd.json"
    caption_json.write_text(json.dumps({"dataset": "rsicd", "images": entries}))
    # training shards: 000000 holds the planted copies among distinct scenes, 000001 only distinct
    # scenes and one corrupt image
    with TarWriter(str(root / "train-000000.tar"), encoder=False) as sink:
        for key, (i, make, ext) in VARIANTS.items():
            sink.write({"__key__": key, ext: make(scene(i)[0]), "txt": b"x"})
        for i in DISTINCT[:12]:
            sink.write({"__key__": f"distinct_{i}", "jpg": encode(scene(i)[0], quality=90), "txt": b"x"})
    with TarWriter(str(root / "train-000001.tar"), encoder=False) as sink:
        for i in DISTINCT[12:]:
            sink.write({"__key__": f"distinct_{i}", "jpg": encode(scene(i)[0], quality=90), "txt": b"x"})
        sink.write({"__key__": "broken", "jpg": b"\xff\xd8\xff not a jpeg", "txt": b"x"})
    return SimpleNamespace(root=root, suite=root / "suite", caption_json=caption_json, paths=paths)


# --------------------------------------------------------------------------- the index

def _random_hashes(rng, n):
    return rng.integers(0, 2 ** 63, (n, 5), dtype=np.int64).astype(np.uint64) * np.uint64(2)


def _flip(rng, hashes: np.ndarray, most: int, words: slice) -> np.ndarray:
    """Flip up to ``most`` random bits of each row within ``words`` (64 bits a word)."""
    out = hashes.copy()
    width = 64 * (words.stop - words.start)
    for row, k in zip(out, rng.integers(0, most + 1, len(out))):
        for bit in rng.choice(width, k, replace=False):
            row[words.start + bit // 64] ^= np.uint64(1) << np.uint64(bit % 64)
    return out


@pytest.mark.parametrize("max_distance,max_fine", [(0, 256), (4, 256), (10, 40), (17, 90)])
def test_index_returns_what_brute_force_returns(max_distance, max_fine):
    rng = np.random.default_rng(max_distance)
    indexed = _random_hashes(rng, 1500)
    queries = indexed[rng.integers(0, 1500, 700)]                       # near copies of indexed ones ...
    queries = _flip(rng, _flip(rng, queries, 2 * max_distance + 2, slice(0, 1)), min(2 * max_fine, 200), slice(1, 5))
    queries = np.concatenate([queries, _random_hashes(rng, 300)])       # ... and unrelated ones
    layout, radius = band_layout(max_distance)     # pigeonhole: some band differs in <= radius bits
    assert sum(w for _, w in layout) == 64 and (radius + 1) * len(layout) > max_distance
    found = HashIndex(indexed[:, 0], indexed[:, 1:], max_distance, max_fine).query(queries[:, 0], queries[:, 1:], batch=256)
    got = set(zip(found.query.tolist(), found.index.tolist(), found.distance.tolist(), found.fine.tolist()))
    expected = brute_force_pairs(queries[:, 0], queries[:, 1:], indexed[:, 0], indexed[:, 1:], max_distance, max_fine)
    assert got == expected
    assert len(expected) > 100 and len(got) == len(found.query)          # found once each, many to find


# --------------------------------------------------------------------------- check-leakage

def test_check_leakage_finds_the_planted_copies_and_nothing_else(suite, tmp_path, capsys):
    out = tmp_path / "report.json"
    proc = _cli(capsys, "check-leakage", "--shards", str(suite.root / "train-{000000..000001}.tar"),
                "--against", str(suite.suite), "--against", str(suite.caption_json), "--out", str(out),
                "--workers", "2")
    assert proc.returncode == 3, proc.stderr
    report = json.loads(out.read_text())
    shard0 = str(suite.root / "train-000000.tar")
    got = {(p["shard"], p["key"], p["set"], p["image"]) for p in report["pairs"]}
    p = suite.paths
    assert got == {(shard0, "resized", "AID", str(p[2])), (shard0, "jpeg_q25", "AID", str(p[3])),
                   (shard0, "png_copy", "UCMerced", str(p[14])), (shard0, "brighter", "rsicd", str(p[21])),
                   (shard0, "copy_of_0", "AID", str(p[0])), (shard0, "copy_of_0", "rsicd", str(p["0b"]))}
    assert all(0 <= q["distance"] <= 10 and 0 <= q["fine_distance"] <= 40 for q in report["pairs"])
    assert report["counts"] == {
        "AID": {"images": 12, "matched_images": 3, "training_images": 3, "pairs": 3},
        "UCMerced": {"images": 8, "matched_images": 1, "training_images": 1, "pairs": 1},
        "rsicd": {"images": 5, "matched_images": 2, "training_images": 2, "pairs": 2}}
    assert report["training_images"] == len(VARIANTS) + len(DISTINCT) and report["training_images_matched"] == 5
    assert report["unreadable"]["training"] == 1 and "broken" in report["unreadable"]["training_examples"][0]
    # the evaluation sets against each other: scene 0 is in AID and (re-encoded) in the caption JSON
    assert [(c["set_a"], c["image_a"], c["set_b"], c["image_b"]) for c in report["cross_set"]["pairs"]] == \
        [("AID", str(p[0]), "rsicd", str(p["0b"]))]
    assert report["cross_set"]["counts"] == {"AID ~ rsicd": 1}
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["training_pairs"] == 6 and summary["cross_set_pairs"] == 1
    assert "UCMerced" in proc.stderr and "AID ~ rsicd" in proc.stderr


def test_check_leakage_clean_shards_and_bad_paths(suite, tmp_path, capsys):
    clean = _cli(capsys, "check-leakage", "--shards", str(suite.root / "train-000001.tar"), "--against",
                 str(suite.suite), "--out", str(tmp_path / "clean.json"), "--workers", "1")
    assert clean.returncode == 0, clean.stderr
    report = json.loads((tmp_path / "clean.json").read_text())
    assert report["pairs"] == [] and report["training_images"] == 12
    assert {k: v["pairs"] for k, v in report["counts"].items()} == {"AID": 0, "UCMerced": 0}
    missing = _cli(capsys, "check-leakage", "--shards", str(suite.root / "train-000001.tar"),
                   "--against", str(tmp_path / "no_such_suite"))
    assert missing.returncode == 2
    assert f"--against {tmp_path / 'no_such_suite'}: no such file or folder" in missing.stderr
    assert "suite root" in missing.stderr and "caption JSON" in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = _cli(capsys, "check-leakage", "--shards", str(suite.root / "train-000001.tar"),
                 "--against", str(tmp_path / "empty"))
    assert empty.returncode == 2 and "no image files under it" in empty.stderr
    no_shards = _cli(capsys, "check-leakage", "--shards", str(tmp_path / "nope-*.tar"), "--against", str(suite.suite))
    assert no_shards.returncode == 2 and "matches no file" in no_shards.stderr


# --------------------------------------------------------------------------- make-shards --exclude-near

def _tar_keys(out: Path) -> set[str]:
    keys = set()
    for shard in out.glob("train-*.tar"):
        with tarfile.open(shard) as tar:
            keys |= {m.name.split(".")[0] for m in tar}
    return keys


def test_make_shards_exclude_near_drops_the_planted_images(suite, tmp_path, capsys):
    folder = tmp_path / "own"
    folder.mkdir()
    for key, (_, make, ext) in VARIANTS.items():
        (folder / f"{key}.{ext}").write_bytes(make(scene(VARIANTS[key][0])[0]))
    for i in DISTINCT:
        (folder / f"distinct_{i}.jpg").write_bytes(encode(scene(i)[0], quality=90))
    for image in folder.iterdir():
        image.with_suffix(".txt").write_text("an aerial image\n")
    proc = _cli(capsys, "make-shards", "--folder", str(folder), "--out", str(tmp_path / "out"),
                "--exclude-near", str(suite.suite), "--exclude-near", str(suite.caption_json))
    assert proc.returncode == 0, proc.stderr
    assert _tar_keys(tmp_path / "out") == {f"distinct_{i}" for i in DISTINCT}
    report = json.loads((tmp_path / "out" / "train-report.json").read_text())
    assert report["skipped"] == {"near_evaluation": 5} and report["num_samples"] == len(DISTINCT)
    pairs = {(Path(p["input"]).stem, p["set"], p["image"]) for p in report["near_evaluation_pairs"]}
    p = suite.paths
    assert pairs == {("resized", "AID", str(p[2])), ("jpeg_q25", "AID", str(p[3])), ("png_copy", "UCMerced", str(p[14])),
                     ("brighter", "rsicd", str(p[21])), ("copy_of_0", "AID", str(p[0])), ("copy_of_0", "rsicd", str(p["0b"]))}
    assert report["exclude_near"]["images"] == 25 and report["exclude_near"]["max_distance"] == 10
    assert "--exclude-near: dropped 5 image(s)" in " ".join(proc.stderr.split())


def test_make_shards_hf_dataset_exclude_near(suite, tmp_path, capsys):
    rows = git10m_rows(12)   # row 3 corrupt, row 8 without a caption (tests/corpora.py)
    for i in range(12):
        if i != 3:
            rows["image"][i] = {"bytes": encode(scene(DISTINCT[i])[0], quality=90), "path": None}
    rows["image"][5] = {"bytes": encode(scene(2)[0].resize((140, 140)), quality=60), "path": None}
    rows["image"][9] = {"bytes": encode(scene(21)[0], quality=75), "path": None}
    data = write_git10m(tmp_path / "git10m", rows=rows, files=2)
    proc = _cli(capsys, "make-shards", "--hf-dataset", str(data), "--out", str(tmp_path / "out"), "--workers", "2",
                "--shard-size", "4", "--exclude-near", str(suite.suite), "--exclude-near", str(suite.caption_json))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "train-report.json").read_text())
    assert report["skipped"] == {"corrupt_image": 1, "empty_caption": 1, "near_evaluation": 2}
    assert [(p["row"], p["img_name"], p["set"], p["image"]) for p in report["near_evaluation_pairs"]] == \
        [(5, "GIT_000005.jpg", "AID", str(suite.paths[2])), (9, "GIT_000009.jpg", "rsicd", str(suite.paths[21]))]
    assert _tar_keys(tmp_path / "out") == {f"{i:09d}" for i in range(12) if i not in (3, 5, 8, 9)}


def test_an_interrupted_exclude_near_conversion_resumes_with_its_pairs(suite, tmp_path):
    """A conversion stopped after its first shards keeps the pairs found so far (the progress file)
    and, rerun, ends with the report and bytes of an uninterrupted one; other evaluation images refuse."""
    from rsclip_ds.data.convert import convert
    from rsclip_ds.data.hf_source import resolve_hf_dataset
    from rsclip_ds.evaluation.leakage import build_near_index

    rows, planted = git10m_rows(12), {1: 2, 9: 21}     # row -> the evaluation scene it copies
    for i in range(12):
        if i != 3:
            rows["image"][i] = {"bytes": encode(scene(planted.get(i, DISTINCT[i]))[0], quality=85), "path": None}
    source = resolve_hf_dataset(str(write_git10m(tmp_path / "git10m", rows=rows, files=2)))
    near = build_near_index([suite.suite, suite.caption_json], workers=1, max_distance=10, max_fine_distance=40,
                            progress=False).near

    def stop_at_row_10(row):
        if row == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(source, tmp_path / "a", shard_size=3, exclude=near, progress=False, on_row=stop_at_row_10)
    convert(source, tmp_path / "a", shard_size=3, exclude=near, progress=False)
    convert(source, tmp_path / "b", shard_size=3, exclude=near, progress=False)
    reports = [json.loads((tmp_path / x / "train-report.json").read_text()) for x in "ab"]
    assert [p["row"] for p in reports[0]["near_evaluation_pairs"]] == [1, 9] and reports[0]["resumed_at_row"] > 1
    assert reports[0]["near_evaluation_pairs"] == reports[1]["near_evaluation_pairs"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "a").glob("*.tar")} == \
        {p.name: p.read_bytes() for p in (tmp_path / "b").glob("*.tar")}
    with pytest.raises(KeyboardInterrupt):
        convert(source, tmp_path / "c", shard_size=3, exclude=near, progress=False, on_row=stop_at_row_10)
    other = build_near_index([suite.suite], workers=1, max_distance=10, max_fine_distance=40, progress=False).near
    with pytest.raises(ValueError, match="differs in: exclude_near"):
        convert(source, tmp_path / "c", shard_size=3, exclude=other, progress=False)


def test_evaluation_images_are_counted_under_the_catalog_names_of_the_sets(tmp_path):
    """A standard set under a folder of another name is counted under its table name (the catalog
    recognises it by its class folders), with all of its images, not only its test split; a folder
    the catalog does not know keeps its own name."""
    from collections import Counter

    from rsclip_ds.evaluation.leakage import evaluation_images
    from tests.rs_sets import write_set

    write_set("UCMerced", tmp_path / "suite", per_class=2, folder="my_ucm_copy")   # 21 classes, split list beside
    other = tmp_path / "suite" / "field_photos" / "sheep"
    other.mkdir(parents=True)
    (other / "a.jpg").write_bytes((tmp_path / "suite").rglob("*.tif").__next__().read_bytes())
    counts = Counter(image.set for image in evaluation_images(tmp_path / "suite"))
    assert counts == {"UCMerced": 42, "field_photos": 1}
