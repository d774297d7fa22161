"""The field's corpora as published (tests/corpora.py builds them): the filter language,
Git-10M from a hub-layout folder / save_to_disk / a hub cache, SkyScript CSVs, Sentinel-2
GeoTIFFs, workers and resume byte-identical, and data.where at load time.

Everything runs in this process (the CLI through ``main(argv)``), in seconds; the one test that
SIGKILLs a real conversion process is marked slow."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rsclip_ds.cli import main
from rsclip_ds.config import DataConfig
from rsclip_ds.data.bad import StreamCounter
from rsclip_ds.data.convert import convert
from rsclip_ds.data.geotiff import BandChoice, BandsError, to_rgb
from rsclip_ds.data.hf_source import resolve_hf_dataset, tile_centre
from rsclip_ds.data.image_check import Checked, header_format, precheck
from rsclip_ds.data.ingest import RowSpec, _tar_header, _tarfile_header, shortest_float32
from rsclip_ds.data.transforms import ImageTransform, SampleDecoder
from rsclip_ds.data.where import Where, WhereError
from tests.corpora import (CORRUPT_ROWS, EMPTY_CAPTION_ROWS, TRUNCATED_ROWS, git10m_dataset, git10m_rows,
                           write_eurosat_ms, write_git10m, write_hub_cache, write_skyscript_csv)

ROOT = Path(__file__).resolve().parents[2]
N = 60


@pytest.fixture(scope="module")
def git10m(tmp_path_factory) -> Path:
    return write_git10m(tmp_path_factory.mktemp("git10m"), n=N, files=3)


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar}


def _shard_bytes(out: Path, prefix: str = "train") -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob(f"{prefix}-*.tar"))}


def _cli(capsys, *args: str) -> SimpleNamespace:
    """`rsclip-ds ARGS` in this process: its exit code, stdout and stderr."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache read under HF_HUB_OFFLINE=1 (the constants huggingface_hub read from
    the environment at import, patched as test_published_checkpoint.py does) -> the cache."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


# --------------------------------------------------------------------------- the filter language

def test_where_language_results_and_refusals():
    rows = [{"s": 0.6, "r": 1.0, "c": "farm"}, {"s": 0.4, "r": 1.0, "c": "farm"}, {"s": 0.9, "r": 4.0, "c": "x"},
            {"r": 1.0}, {"s": None, "r": 1.0}]
    keep = Where.parse("s >= 0.5 and r <= 2")
    assert [keep(r) for r in rows] == [True, False, False, False, False]   # missing / null: false
    assert [Where.parse("not s >= 0.5")(r) for r in rows] == [False, True, False, True, True]
    assert [Where.parse("0.5 <= s < 0.95 and c in ['farm', 'x']")(r) for r in rows] == [True, False, True, False, False]
    assert Where.parse("len(c) > 3 or s == null")({"c": "farm"}) and Where.parse("s == null")({"s": None})
    assert Where.parse("s >= 0.5 and len(c) > 1").columns == ["c", "s"]
    assert Where.parse(None)({}) and not Where.parse("")
    for text in ("__import__('os').system('true')", "s.real > 0", "s + 1 > 2", "[x for x in s]", "s >"):
        with pytest.raises(WhereError, match="allowed"):
            Where.parse(text)
    with pytest.raises(WhereError, match="cannot compare"):
        Where.parse("c > 3")({"c": "farm"})
    with pytest.raises(WhereError, match=r"names \['scroe'\].*its columns"):
        Where.parse("scroe > 1").check_columns(["score"], "the table")
    with pytest.raises(ValueError, match="Attribute is not allowed"):
        DataConfig(where="a.b > 1")


def test_tile_centre_matches_the_slippy_map_formula():
    assert tile_centre("0_0_0") == (0.0, 0.0)
    lat, lon = tile_centre("18_140000_90000")
    assert lon == pytest.approx((140000.5 / 2 ** 18) * 360 - 180, abs=1e-6)
    assert lat == pytest.approx(np.degrees(np.arctan(np.sinh(np.pi * (1 - 2 * 90000.5 / 2 ** 18)))), abs=1e-6)
    assert tile_centre("0_GOOGLE_LEVEL") is None and tile_centre("3_9_0") is None


# --------------------------------------------------------------------------- Git-10M

def test_git10m_folder_to_shards_keeps_bytes_metadata_and_counts_skips(git10m, tmp_path):
    out = tmp_path / "shards"
    info = convert(resolve_hf_dataset(str(git10m)), out, shard_size=16, progress=False,
                   spec=RowSpec(where="img_quality_score >= 0.3"))
    rows = git10m_rows(N)
    passes = [i for i in range(N) if rows["img_quality_score"][i] >= 0.3]
    filtered = N - len(passes)
    corrupt = [i for i in passes if i in CORRUPT_ROWS + TRUNCATED_ROWS]
    empty = [i for i in passes if i in EMPTY_CAPTION_ROWS and i not in corrupt]
    good = [i for i in passes if i not in corrupt + empty]
    assert info["skipped"] == {"filtered_out": filtered, "corrupt_image": len(corrupt), "empty_caption": len(empty)}
    assert info["num_samples"] == len(good) and len(corrupt) >= 1 and len(empty) >= 1
    members = {}
    for name in sorted(out.glob("train-*.tar")):
        members.update(_members(name))
    i = good[0]
    assert members[f"{i:09d}.jpg"] == rows["image"][i]["bytes"]                 # copied as they are
    meta = json.loads(members[f"{i:09d}.json"])
    lat, lon = tile_centre(rows["Google_location"][i])
    assert meta == {"filename": f"GIT_{i:06d}.jpg", "img_name": f"GIT_{i:06d}.jpg", "captions": [rows["caption"][i]],
                    "caption": rows["caption"][i], "split": "train", "caption_length": rows["caption_length"][i],
                    "resolution": rows["resolution"][i], "Google_location": rows["Google_location"][i],
                    "img_quality_score": rows["img_quality_score"][i], "latitude": lat, "longitude": lon}
    assert f'"img_quality_score": {rows["img_quality_score"][i]},'.encode() in members[f"{i:09d}.json"]   # not 0.37000000476
    assert isinstance(meta["caption_length"], int) and isinstance(meta["resolution"], float)
    index = json.loads((out / "index.json").read_text())
    assert sum(e["num_samples"] for e in index["shards"]) == len(good)
    cols = index["splits"]["train"]["columns"]
    assert cols["resolution"] == {"types": ["number"], "min": 0.5, "max": 4.0}   # zoom 18..15
    assert cols["img_quality_score"]["min"] >= 0.3 - 1e-6
    report = json.loads((out / "train-report.json").read_text())
    assert any(f"row {corrupt[0]}:" in e for e in report["skipped_examples"]["corrupt_image"])


def test_tar_blocks_and_header_checks_equal_what_they_replace():
    """The writer's ustar headers are tarfile's, byte for byte; the header check settles JPEG/PNG/WebP
    (kept, truncated, broken) and leaves the rest to PIL in a worker."""
    for name, size in [("000000001.jpg", 12345), ("000000002.json", 0), ("a" * 100, 7), ("x.txt", 8 ** 11 - 1),
                       ("é.txt", 3)]:
        assert _tar_header(name, size) == _tarfile_header(name, size), name
    from PIL import Image
    from tests.corpora import jpeg

    good, png = jpeg(1, 16), io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    webp = b"RIFF\x10\x00\x00\x00WEBPVP8 " + bytes(8)
    assert [header_format(b) for b in (good, png.getvalue(), webp, b"GIF89a....")] == ["JPEG", "PNG", "WEBP", None]
    for broken in (good[:20] + b"\x00\x00" + good[22:], b"\xff\xd8\xff\xe0\xff\xff" + good[6:], good[:20]):
        with pytest.raises(OSError, match="JPEG"):
            header_format(broken)
    assert precheck(good, "keep", "header", 0, "image") == Checked("jpg", len(good))
    assert precheck(good[: len(good) // 2], "keep", "header", 0, "image").problem[0] == "corrupt_image"
    assert precheck(None, "keep", "header", 0, "image").problem[0] == "missing_image"
    for needs_pil in ((good, "png", "header", 0), (good, "keep", "decode", 0), (good, "keep", "header", 8),
                      (b"\xa0not an image", "keep", "header", 0)):
        assert precheck(*needs_pil, "image") is None
    assert shortest_float32(float(np.float32(0.98))) == 0.98 and shortest_float32(3) == 3


def test_git10m_save_to_disk_and_hub_cache_give_the_same_shards(git10m, tmp_path, offline_hub, capsys):
    direct = tmp_path / "direct"
    convert(resolve_hf_dataset(str(git10m)), direct, shard_size=16, progress=False)
    saved = tmp_path / "saved"
    git10m_dataset(N).save_to_disk(str(saved))
    convert(resolve_hf_dataset(str(saved)), tmp_path / "from_saved", shard_size=16, progress=False)
    assert _shard_bytes(tmp_path / "from_saved") == _shard_bytes(direct)
    # a hub id from the standard cache, offline
    write_hub_cache(offline_hub, "lcybuaa/Git-10M", git10m)
    proc = _cli(capsys, "make-shards", "--hf-dataset", "lcybuaa/Git-10M", "--out", str(tmp_path / "hub_out"),
                "--shard-size", "16")
    assert proc.returncode == 0, proc.stderr
    assert _shard_bytes(tmp_path / "hub_out") == _shard_bytes(direct)
    index = json.loads((tmp_path / "hub_out" / "index.json").read_text())
    assert index["splits"]["train"]["source"]["commit"] == "feedfacefeedfacefeedfacefeedfacefeedface"
    proc = _cli(capsys, "make-shards", "--hf-dataset", "lcybuaa/Git-99M", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "HF_HUB_OFFLINE" in proc.stderr and str(offline_hub) in proc.stderr


def test_bad_input_errors_name_the_fix(git10m, tmp_path, capsys):
    src = resolve_hf_dataset(str(git10m))
    with pytest.raises(ValueError, match=r"no column 'captoin'; its columns: \['image', 'img_name'"):
        convert(src, tmp_path / "a", spec=RowSpec(caption_columns=("captoin",)), progress=False)
    with pytest.raises(WhereError, match="img_quality"):
        convert(src, tmp_path / "a", spec=RowSpec(where="img_quality > 1"), progress=False)
    with pytest.raises(ValueError, match="no split 'test'"):
        resolve_hf_dataset(str(git10m), split="test")
    parquet = next((git10m / "data").glob("*.parquet"))
    proc = _cli(capsys, "make-shards", "--table", str(parquet), "--out", str(tmp_path / "t"))
    assert proc.returncode == 2 and "is a parquet file" in proc.stderr and "--hf-dataset" in proc.stderr
    assert "utf-8" not in proc.stderr


class _Killed(BaseException):
    """Stands for a kill: not an Exception, so nothing in convert() handles it."""


def _reference(git10m: Path, out: Path) -> Path:
    convert(resolve_hf_dataset(str(git10m)), out, shard_size=8, progress=False, chunk_rows=7)
    return out


def test_workers_and_an_interrupted_resume_write_the_same_bytes(git10m, tmp_path):
    src = resolve_hf_dataset(str(git10m))
    one = _reference(git10m, tmp_path / "one")
    convert(src, tmp_path / "two", shard_size=8, workers=2, progress=False, chunk_rows=7)
    assert _shard_bytes(tmp_path / "two") == _shard_bytes(one)
    assert (tmp_path / "two" / "index.json").read_bytes() == (one / "index.json").read_bytes()
    # stopped at row 37 (shards 0-2 complete, the fourth half written), then the same call again
    cut = tmp_path / "cut"

    def stop(i):
        if i == 37:
            raise _Killed

    with pytest.raises(_Killed):
        convert(src, cut, shard_size=8, progress=False, chunk_rows=7, on_row=stop)
    progress = json.loads((cut / "train-progress.json").read_text())
    assert len(progress["shards"]) >= 2 and 0 < progress["rows_done"] < 37
    # what a SIGKILL leaves besides (the slow test below kills a real process): a torn shard and
    # a complete one the progress file does not vouch for yet
    (cut / "train-000003.tar.partial").write_bytes(b"torn")
    (cut / f"train-{len(progress['shards']):06d}.tar").write_bytes(b"not vouched for")
    info = convert(src, cut, shard_size=8, progress=False, chunk_rows=7)
    assert not list(cut.glob("*.partial")) and not (cut / "train-progress.json").exists()
    assert _shard_bytes(cut) == _shard_bytes(one)
    assert json.loads((cut / "index.json").read_text()) == json.loads((one / "index.json").read_text())
    assert info["skipped"] == json.loads((one / "train-report.json").read_text())["skipped"]
    assert json.loads((cut / "train-report.json").read_text())["resumed_at_row"] == progress["rows_done"]
    # other options against the interrupted run's progress: refused, naming --restart
    (cut / "train-progress.json").write_text(json.dumps(progress))
    with pytest.raises(ValueError, match="--restart"):
        convert(src, cut, shard_size=5, progress=False)
    convert(src, cut, shard_size=8, progress=False, restart=True)
    assert _shard_bytes(cut) == _shard_bytes(one)


@pytest.mark.slow
def test_a_sigkilled_conversion_resumes_byte_identical(git10m, tmp_path):
    """A real SIGKILL mid-shard (row 37) of a conversion process, then the same call again."""
    killed = tmp_path / "killed"
    code = ("import os, signal; from rsclip_ds.data.convert import convert; "
            "from rsclip_ds.data.hf_source import resolve_hf_dataset as r; "
            f"convert(r({str(git10m)!r}), {str(killed)!r}, shard_size=8, progress=False, chunk_rows=7, "
            "on_row=lambda i: os.kill(os.getpid(), signal.SIGKILL) if i == 37 else None)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          timeout=120)
    assert proc.returncode == -9
    progress = json.loads((killed / "train-progress.json").read_text())
    assert len(progress["shards"]) >= 2 and 0 < progress["rows_done"] < 37
    assert list(killed.glob("*.partial"))                      # the torn shard is there ...
    convert(resolve_hf_dataset(str(git10m)), killed, shard_size=8, progress=False, chunk_rows=7)
    assert not list(killed.glob("*.partial")) and not (killed / "train-progress.json").exists()   # ... and gone
    assert _shard_bytes(killed) == _shard_bytes(_reference(git10m, tmp_path / "one"))


# --------------------------------------------------------------------------- SkyScript, GeoTIFF

def test_skyscript_csv_keeps_both_captions_the_score_and_filters_on_it(tmp_path, capsys):
    csv_path = write_skyscript_csv(tmp_path / "sky", n=12)
    out = tmp_path / "out"
    proc = _cli(capsys, "make-shards", "--table", str(csv_path), "--path-column", "filepath", "--caption-column",
                "title,title_multi_objects", "--where", "similarity_CLIP_openai >= 0.3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    kept = [i for i in range(12) if 0.2 + 0.02 * i >= 0.3 - 1e-9]
    assert summary["num_samples"] == len(kept) and summary["skipped"] == {"filtered_out": 12 - len(kept)}
    members = _members(out / "train-000000.tar")
    i = kept[0]
    txt = members[f"images__sky_{i}.txt"].decode().splitlines()
    assert txt == [f"a satellite image of a {['pond', 'road', 'farm'][i % 3]}", f"a satellite image of {i % 4 + 1} objects"]
    meta = json.loads(members[f"images__sky_{i}.json"])
    assert meta["similarity_CLIP_openai"] == pytest.approx(0.2 + 0.02 * i) and isinstance(meta["similarity_CLIP_openai"], float)


def test_sentinel2_bands_in_make_shards_and_eval_transform(tmp_path, capsys):
    root = write_eurosat_ms(tmp_path / "ms", per_class=2)
    tif = next(root.rglob("*.tif"))
    data = tif.read_bytes()
    with pytest.raises(BandsError, match="13-band uint16 TIFF.*--bands 4,3,2"):
        ImageTransform(16)(data)                                   # not counted unreadable: stops
    rgb = to_rgb(data, BandChoice.parse("4,3,2", "range:0,3000"))
    from tests.corpora import eurosat_ms
    raw = eurosat_ms(0).astype(np.float64)[..., [3, 2, 1]]
    assert rgb.shape == (64, 64, 3) and rgb.dtype == np.uint8
    assert np.array_equal(rgb, np.rint(255 * np.clip(raw / 3000, 0, 1)).astype(np.uint8))
    pct = to_rgb(data, BandChoice.parse("4,3,2"))
    assert pct.min() == 0 and pct.max() == 255                     # per-band 2-98 % stretch
    with pytest.raises(ValueError, match="band-scale"):
        BandChoice.parse("4,3,2", "minmax")
    with pytest.raises(BandsError, match="band 14, the file has 13"):
        to_rgb(data, BandChoice.parse("14,3,2"))
    assert ImageTransform(16, bands=BandChoice.parse("4,3,2"))(data).shape == (16, 16, 3)
    # make-shards --folder with --bands: PNG of the chosen bands; without: an error naming --bands
    for i, p in enumerate(sorted(root.rglob("*.tif"))):
        p.with_suffix(".txt").write_text(f"a sentinel-2 image {i}\n")
    proc = _cli(capsys, "make-shards", "--folder", str(root), "--out", str(tmp_path / "no"))
    assert proc.returncode == 2 and "--bands" in proc.stderr
    proc = _cli(capsys, "make-shards", "--folder", str(root), "--out", str(tmp_path / "s"), "--bands", "4,3,2",
                "--band-scale", "range:0,3000")
    assert proc.returncode == 0, proc.stderr
    members = _members(tmp_path / "s" / "train-000000.tar")
    from PIL import Image
    import io
    png = members["AnnualCrop__AnnualCrop_1.png"]
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), rgb)


# --------------------------------------------------------------------------- data.where at load time

def test_data_where_drops_samples_by_their_json_and_counts_them():
    prep = SampleDecoder(ImageTransform(8), ["jpg"], ["txt"], Where.parse("img_quality_score >= 0.5"))
    from tests.corpora import jpeg
    counter = StreamCounter({})
    kept = []
    for i, score in enumerate([0.9, 0.1, 0.5, None, 0.7]):
        sample = {"__key__": f"k{i}", "__url__": "u.tar", "jpg": jpeg(i, 8), "txt": b"a caption",
                  "json": json.dumps({"img_quality_score": score}).encode()}
        kept.append(prep(sample, random.Random(0), counter) is not None)
    assert kept == [True, False, True, False, True]
    assert counter.bad["filtered_out"] == 2 and counter.bad["corrupt_image"] == 0 and not counter.events
