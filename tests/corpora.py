"""Inputs shaped like the field's published corpora, built locally (no hub access):

- ``write_git10m``: a Git-10M-shaped dataset (lcybuaa/Git-10M's columns and types: an Image
  feature, img_name, img_quality_score float32, caption, caption_length int64, resolution
  float64, Google_location 'Z_X_Y') as hub-layout parquet shards (data/train-0000k-of-0000n.parquet),
  written with the `datasets` library, with planted faults: corrupt image bytes, a truncated JPEG,
  empty captions.
- ``write_hub_cache``: that folder as huggingface_hub caches a dataset repo
  (datasets--lcybuaa--Git-10M/{blobs,snapshots/<commit>,refs/main}).
- ``write_skyscript_csv``: SkyScript's CSV columns (filepath, title, title_multi_objects,
  similarity_CLIP_openai) with its images.
- ``write_eurosat_ms``: 13-band uint16 GeoTIFFs as EuroSAT's all-bands release ships them
  (64 x 64, bands last, B01..B12 with B8A).
"""

from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

COMMIT = "feedfacefeedfacefeedfacefeedfacefeedface"
CORRUPT_ROWS = (3, 17)       # image bytes that are not an image
TRUNCATED_ROWS = (29,)       # a JPEG cut in half
EMPTY_CAPTION_ROWS = (8, 40)


def jpeg(seed: int, size: int = 32) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = (rng.random((size, size, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def git10m_rows(n: int) -> dict[str, list]:
    rows = {"image": [], "img_name": [], "img_quality_score": [], "caption": [], "caption_length": [],
            "resolution": [], "Google_location": []}
    for i in range(n):
        data = jpeg(i)
        if i in CORRUPT_ROWS:
            data = b"\xa0not an image " * 8
        elif i in TRUNCATED_ROWS:
            data = data[: len(data) // 2]
        zoom = 15 + i % 4                                   # resolution = 2^(17-Z) m/px
        caption = "" if i in EMPTY_CAPTION_ROWS else f"an aerial image of {i % 7} buildings near a road"
        rows["image"].append({"bytes": data, "path": None})
        rows["img_name"].append(f"GIT_{i:06d}.jpg")
        rows["img_quality_score"].append(round((i * 37 % 100) / 100, 2))
        rows["caption"].append(caption)
        rows["caption_length"].append(len(caption.split()))
        rows["resolution"].append(2.0 ** (17 - zoom))
        rows["Google_location"].append(f"{zoom}_{1000 + i}_{2000 + i}")
    return rows


def git10m_dataset(n: int, rows: dict[str, list] | None = None):
    """``rows`` (default: git10m_rows(n), faults planted) as a datasets.Dataset of Git-10M's features."""
    import datasets

    features = datasets.Features({
        "image": datasets.Image(), "img_name": datasets.Value("string"),
        "img_quality_score": datasets.Value("float32"), "caption": datasets.Value("string"),
        "caption_length": datasets.Value("int64"), "resolution": datasets.Value("float64"),
        "Google_location": datasets.Value("string")})
    return datasets.Dataset.from_dict(rows or git10m_rows(n), features=features)


def write_git10m(root: Path, n: int = 60, files: int = 3, rows: dict[str, list] | None = None) -> Path:
    """``root``/data/train-0000k-of-0000n.parquet (the hub's repo layout) + a README; -> root.
    ``rows``: git10m_rows(n) with changes (default: as it is)."""
    ds = git10m_dataset(n, rows)
    (root / "data").mkdir(parents=True, exist_ok=True)
    for k in range(files):
        ds.shard(files, k, contiguous=True).to_parquet(str(root / "data" / f"train-{k:05d}-of-{files:05d}.parquet"))
    (root / "README.md").write_text("---\nlicense: cc-by-nc-nd-4.0\n---\n# Git-10M (test copy)\n")
    return root


def write_hub_cache(cache: Path, repo: str, folder: Path, commit: str = COMMIT) -> Path:
    """``folder`` as revision ``commit`` of dataset ``repo`` in a huggingface_hub cache (blobs, a
    snapshot of relative links, refs/main); point HF_HUB_CACHE at ``cache``. -> the snapshot."""
    base = cache / f"datasets--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    (base / "blobs").mkdir()
    snap = base / "snapshots" / commit
    for i, item in enumerate(sorted(p for p in folder.rglob("*") if p.is_file())):
        blob = base / "blobs" / f"{i:064x}"
        shutil.copy2(item, blob)
        link = snap / item.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (len(item.relative_to(folder).parts) + 1)) / "blobs" / blob.name)
    return snap


def write_skyscript_csv(root: Path, n: int = 12, scores: list[float] | None = None) -> Path:
    """SkyScript-style: images/ + a CSV with two caption columns and a CLIP similarity score
    (default 0.2 + 0.02 i for row i)."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    path = root / "skyscript_train.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filepath", "title", "title_multi_objects", "similarity_CLIP_openai"])
        for i in range(n):
            (root / "images" / f"sky_{i}.jpg").write_bytes(jpeg(100 + i))
            w.writerow([f"images/sky_{i}.jpg", f"a satellite image of a {['pond', 'road', 'farm'][i % 3]}",
                        f"a satellite image of {i % 4 + 1} objects",
                        f"{0.2 + 0.02 * i if scores is None else scores[i]:.2f}"])
    return path


def eurosat_ms(seed: int, size: int = 64) -> np.ndarray:
    """(H, W, 13) uint16 reflectance x 10000, band b around 500 * b."""
    rng = np.random.default_rng(seed)
    base = np.arange(1, 14, dtype=np.float32)[None, None, :] * 500
    return (base + rng.random((size, size, 13)) * 400).astype(np.uint16)


def write_eurosat_ms(root: Path, classes=("AnnualCrop", "Forest"), per_class: int = 3) -> Path:
    """root/<Class>/<Class>_<i>.tif, 13-band uint16, bands last (as EuroSAT-MS); -> root."""
    import tifffile

    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            tifffile.imwrite(root / name / f"{name}_{i + 1}.tif", eurosat_ms(10 * c + i),
                             photometric="minisblack", planarconfig="contig")
    return root
