"""make-shards: the three input formats, limits, index, reports, byte-identical output, and the
loader reading what it wrote."""

from __future__ import annotations

import csv
import io
import itertools
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from rsclip_ds.cli import main
from rsclip_ds.config import DataConfig
from rsclip_ds.data import build_train_loader


def _image(path, size=(24, 24), seed=0, fmt=None):
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path, format=fmt)


def _members(tar_path):
    with tarfile.open(tar_path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar}


@pytest.fixture
def rsicd(tmp_path):
    """A tiny RSICD-like dataset: 5 train images (one .tif, one missing, one broken), val, test."""
    img = tmp_path / "RSICD_images"
    for i, name in enumerate(["airport_1.jpg", "beach_2.jpg", "farm_3.tif", "port_4.jpg", "val_1.jpg",
                              "test_1.jpg"]):
        _image(img / name, seed=i, fmt="TIFF" if name.endswith(".tif") else "JPEG")
    (img / "broken_5.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    entries = [("airport_1.jpg", "train", 5), ("beach_2.jpg", "train", 2), ("farm_3.tif", "train", 3),
               ("port_4.jpg", "train", 1), ("gone_9.jpg", "train", 2), ("broken_5.jpg", "train", 2),
               ("val_1.jpg", "val", 5), ("test_1.jpg", "test", 5)]
    data = {"dataset": "rsicd", "images": [
        {"filename": f, "imgid": i, "split": s, "sentids": list(range(n)),
         "sentences": [{"raw": f" {f.split('_')[0]}  caption" + " more" * j, "tokens": [], "imgid": i, "sentid": j}
                       for j in range(n)]} for i, (f, s, n) in enumerate(entries)]}
    (tmp_path / "dataset_rsicd.json").write_text(json.dumps(data))
    return tmp_path


def _run(*argv) -> int:
    return main(["make-shards", *map(str, argv)])


def test_karpathy_json_train_split(rsicd, capsys):
    out = rsicd / "shards"
    assert _run("--karpathy", rsicd / "dataset_rsicd.json", "--images", rsicd / "RSICD_images",
                "--split", "train", "--out", out, "--shard-size", 2) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == {"train_shards": str(out / "train-{000000..000001}.tar"), "num_samples": 4,
                       "num_shards": 2, "skipped": {"missing_image": 1, "unreadable_image": 1}}
    index = json.loads((out / "index.json").read_text())
    assert [(e["url"], e["num_samples"]) for e in index["shards"]] == [("train-000000.tar", 2),
                                                                        ("train-000001.tar", 2)]
    first, second = _members(out / "train-000000.tar"), _members(out / "train-000001.tar")
    assert sorted(first) == ["airport_1.jpg", "airport_1.json", "airport_1.txt",
                             "beach_2.jpg", "beach_2.json", "beach_2.txt"]
    assert sorted(second) == ["farm_3.json", "farm_3.tif", "farm_3.txt", "port_4.jpg", "port_4.json", "port_4.txt"]
    # all captions kept, whitespace normalised; files copied byte for byte (tif included)
    assert first["airport_1.txt"].decode().splitlines() == [f"airport caption{' more' * j}" for j in range(5)]
    assert first["airport_1.jpg"] == (rsicd / "RSICD_images" / "airport_1.jpg").read_bytes()
    assert second["farm_3.tif"] == (rsicd / "RSICD_images" / "farm_3.tif").read_bytes()
    assert json.loads(first["beach_2.json"]) == {"filename": "beach_2.jpg", "split": "train",
                                                 "captions": ["beach caption", "beach caption more"]}
    report = json.loads((out / "train-report.json").read_text())
    assert report["skipped_paths"]["missing_image"][0].startswith(str(rsicd / "RSICD_images" / "gone_9.jpg"))
    assert "broken_5.jpg" in report["skipped_paths"]["unreadable_image"][0]


def test_same_input_gives_byte_identical_shards_with_any_workers(rsicd):
    outs = []
    for name, workers in (("a", 1), ("b", 1), ("c", 2)):
        out = rsicd / name
        _run("--karpathy", rsicd / "dataset_rsicd.json", "--images", rsicd / "RSICD_images",
             "--out", out, "--shard-size", 3, "--max-side", 16, "--workers", workers)
        outs.append(out)
    tars = [sorted(o.glob("*.tar")) for o in outs]
    assert [t.name for t in tars[0]] == ["train-000000.tar", "train-000001.tar"]   # 6 images, all splits
    for other in tars[1:]:
        assert [t.read_bytes() for t in other] == [t.read_bytes() for t in tars[0]]


def test_reencode_to_max_side_and_splits_share_one_index(rsicd):
    out = rsicd / "shards"
    for split in ("val", "test"):
        _run("--karpathy", rsicd / "dataset_rsicd.json", "--images", rsicd / "RSICD_images",
             "--split", split, "--out", out)
    _image(rsicd / "RSICD_images" / "val_1.jpg", size=(64, 32))
    _run("--karpathy", rsicd / "dataset_rsicd.json", "--images", rsicd / "RSICD_images", "--split", "val",
         "--out", out, "--max-side", 16, "--format", "png")
    index = json.loads((out / "index.json").read_text())
    assert [e["url"] for e in index["shards"]] == ["test-000000.tar", "val-000000.tar"]
    png = _members(out / "val-000000.tar")["val_1.png"]
    assert Image.open(io.BytesIO(png)).size == (16, 8)


def test_table_csv_and_jsonl_with_named_columns(tmp_path, capsys):
    for i in range(3):
        _image(tmp_path / "imgs" / f"{i}.png", seed=i, fmt="PNG")
    rows = [("imgs/0.png", "a field", "train"), ("imgs/1.png", "a road", "train"),
            ("imgs/0.png", "green field", "train"), ("imgs/2.png", "a lake", "val"), ("imgs/1.png", "", "train")]
    with (tmp_path / "pairs.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filepath", "title", "subset"])
        w.writerows(rows)
    (tmp_path / "pairs.jsonl").write_text("".join(
        json.dumps({"filepath": p, "title": c, "subset": s}) + "\n" for p, c, s in rows))
    for table in ("pairs.csv", "pairs.jsonl"):
        out = tmp_path / table.replace(".", "_")
        assert _run("--table", tmp_path / table, "--path-column", "filepath", "--caption-column", "title",
                    "--split-column", "subset", "--split", "train", "--out", out) == 0
        members = _members(out / "train-000000.tar")
        assert members["imgs__0.txt"] == b"a field\ngreen field"   # rows of one image merged
        assert members["imgs__1.txt"] == b"a road"
        assert "imgs__2.txt" not in members
    with pytest.raises(SystemExit):
        _run("--table", tmp_path / "pairs.csv", "--out", tmp_path / "x", "--folder", tmp_path)
    assert _run("--table", tmp_path / "pairs.csv", "--out", tmp_path / "x") == 2
    assert "no column 'path'; it has ['filepath', 'subset', 'title']" in capsys.readouterr().err


def test_folder_with_sidecar_txt_and_count_limits(tmp_path):
    src = tmp_path / "uc"
    for i in range(7):
        _image(src / "dense" / f"d{i:02d}.jpg", size=(32, 32), seed=i)
        if i != 3:
            (src / "dense" / f"d{i:02d}.txt").write_text(f"dense houses {i}\nmany roofs {i}\n")
    out = tmp_path / "out"
    assert _run("--folder", src, "--out", out, "--shard-bytes", 2000) == 0
    index = json.loads((out / "index.json").read_text())
    counts = [e["num_samples"] for e in index["shards"]]
    assert sum(counts) == 6 and len(counts) > 1     # byte limit closes shards
    assert all(e["bytes"] < 2000 + 1500 for e in index["shards"])
    report = json.loads((out / "train-report.json").read_text())
    assert report["skipped_paths"] == {"missing_caption": [f"{src}/dense/d03.jpg: no caption"]}
    assert report["skipped"] == {"missing_caption": 1}


def test_no_usable_input_is_an_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert _run("--folder", tmp_path / "empty", "--out", tmp_path / "out") == 2
    assert "no usable input" in capsys.readouterr().err


def test_loader_reads_made_shards_and_draws_every_caption(rsicd, tiny_tokenizer):
    out = rsicd / "shards"
    _run("--karpathy", rsicd / "dataset_rsicd.json", "--images", rsicd / "RSICD_images", "--out", out,
         "--shard-size", 2)
    cfg = DataConfig(train_shards=str(out / "train-{000000..000002}.tar"), num_workers=0, shuffle_buffer=0)
    loader = build_train_loader(cfg, tokenizer=tiny_tokenizer, image_size=8, max_text_length=40, micro_batch_size=2,
                                rank=0, world_size=1, seed=0, return_keys=True)
    assert loader.schedule.counts == {str(out / f"train-00000{i}.tar"): n for i, n in enumerate([2, 2, 2])}
    seen: dict[str, set] = {}
    for batch in itertools.islice(iter(loader), 60):   # 20 epochs of 3 batches
        for key, ids in zip(batch["keys"], batch["input_ids"]):
            seen.setdefault(key, set()).add(tuple(ids.tolist()))
    assert sorted(seen) == ["airport_1", "beach_2", "farm_3", "port_4", "test_1", "val_1"]
    assert len(seen["airport_1"]) == 5 and len(seen["beach_2"]) == 2 and len(seen["port_4"]) == 1


def test_bmp_becomes_png_and_resized_tif_becomes_jpeg(tmp_path):
    from rsclip_ds.data.shard_writer import Encoding, load_image
    _image(tmp_path / "a.bmp", size=(20, 10), fmt="BMP")
    _image(tmp_path / "b.tif", size=(40, 20), fmt="TIFF")
    data, ext = load_image(tmp_path / "a.bmp", Encoding())
    assert ext == "png" and np.array_equal(np.asarray(Image.open(io.BytesIO(data))),
                                           np.asarray(Image.open(tmp_path / "a.bmp")))   # lossless
    data, ext = load_image(tmp_path / "b.tif", Encoding(max_side=10))
    assert ext == "jpg" and Image.open(io.BytesIO(data)).size == (10, 5)
    assert load_image(tmp_path / "b.tif", Encoding()) == ((tmp_path / "b.tif").read_bytes(), "tif")
