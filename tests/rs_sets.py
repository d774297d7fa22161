"""The field's evaluation sets written in their published layouts, with tiny images, for tests.

    write_set("UCMerced", root)            -> root/UCMerced_LandUse (Images/<class>/<class>NN.tif,
                                              and torchgeo's uc_merced-test.txt beside it)
    write_set("AID", root, folder="AID_dataset", per_class=3)
    write_suite(root)                      -> every set of the catalog under one root

The class folders are the catalog's release names (rsclip_ds/evaluation/sets/<set>.json); what this
module adds is each release's shape: the nesting (UCMerced_LandUse/Images, PatternNet/images,
MLRSNet/Images + Labels, RSI-CB256's category folders, Million-AID's train/<level-1>/<level-2>/
<level-3>), the file names and types, and where the split lists lie (torchgeo puts
uc_merced-test.txt and resisc45-test.txt beside the set's folder). Every image is distinct (noise
seeded by its index), so leakage tests can plant copies among them.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

from PIL import Image

from rsclip_ds.evaluation.catalog import SetSpec, spec_named

SIZE = 16
FORMATS = {".jpg": "JPEG", ".tif": "TIFF", ".png": "PNG"}

# set name -> (top folder, class-folder path under it, file name pattern, extension)
LAYOUTS = {
    "AID": ("AID", "{folder}", "{lower}_{i}", ".jpg"),
    "EuroSAT": ("EuroSAT", "2750/{folder}", "{folder}_{i}", ".jpg"),
    "NWPU-RESISC45": ("NWPU-RESISC45", "{folder}", "{folder}_{i:03d}", ".jpg"),
    "UCMerced": ("UCMerced_LandUse", "Images/{folder}", "{folder}{i:02d}", ".tif"),
    "WHU-RS19": ("WHU-RS19", "{folder}", "{lower}_{i:02d}", ".jpg"),
    "RSSCN7": ("RSSCN7", "{folder}", "{first}{i:03d}", ".jpg"),
    "OPTIMAL-31": ("OPTIMAL-31", "Images/{folder}", "{folder}_{i:03d}", ".jpg"),
    "RSC11": ("RSC11", "{folder}", "{i:03d}", ".tif"),
    "RSI-CB128": ("RSI-CB128", "{folder}", "{folder}({i})", ".tif"),
    "RSI-CB256": ("RSI-CB256", "{group}/{folder}", "{folder}({i})", ".jpg"),
    "CLRS": ("CLRS", "{folder}", "{folder}_{i:04d}", ".tif"),
    "PatternNet": ("PatternNet", "images/{folder}", "{folder}{i:03d}", ".jpg"),
    "MLRSNet": ("MLRSNet", "Images/{folder}", "{folder}_{i:05d}", ".jpg"),
    "MillionAID": ("Million-AID", "train/{path}", "P{n:07d}", ".jpg"),
}
# where the published split list lies, relative to the set's top folder, and its name
SPLIT_LISTS = {"EuroSAT": "eurosat-test.txt", "NWPU-RESISC45": "../resisc45-test.txt",
               "UCMerced": "../uc_merced-test.txt"}
CAPTIONS = {  # retrieval: top folder, JSON name, image folder, extension
    "RSICD": ("RSICD", "dataset_rsicd.json", "RSICD_images", ".jpg"),
    "RSITMD": ("RSITMD", "dataset_RSITMD.json", "images", ".tif"),
    "UCM-captions": ("UCM_captions", "dataset.json", "imgs", ".tif"),
    "Sydney-captions": ("Sydney_captions", "dataset.json", "imgs", ".tif"),
}


def image_bytes(index: int, ext: str = ".jpg") -> bytes:
    """A SIZE x SIZE image of noise seeded by ``index``: no two indices alike, nor near-duplicates."""
    pixels = random.Random(index).randbytes(SIZE * SIZE * 3)
    buffer = io.BytesIO()
    Image.frombytes("RGB", (SIZE, SIZE), pixels).save(buffer, FORMATS[ext])
    return buffer.getvalue()


class _Counter:
    value = 0

    def next(self) -> int:
        _Counter.value += 1
        return _Counter.value


def _spec(name: str) -> SetSpec:
    spec = spec_named(name)
    if spec is None:
        raise KeyError(f"no catalog set {name!r}")
    return spec


def write_set(name: str, root: str | Path, per_class: int = 2, folder: str | None = None,
              split_list: bool = True) -> Path:
    """Write set ``name`` (a catalog name) under ``root`` in its published layout; returns its top folder.
    ``per_class`` images per class (retrieval: images in all, half of them test); ``folder`` renames the
    top folder (an alias users have); ``split_list`` writes the published test list where there is one
    (the last image of each class is the test image)."""
    spec, root = _spec(name), Path(root)
    if spec.task == "retrieval":
        return _write_captions(spec, root, max(per_class, 2), folder)
    top_name, class_path, pattern, ext = LAYOUTS[spec.name]
    top = root / (folder or top_name)
    group_of = {c: g for g, members in (spec.groups or {}).items() for c in members}
    paths = (spec.hierarchy or {}).get("paths", {})
    tests, counter = [], _Counter()
    for class_folder in spec.classes:
        where = top / class_path.format(folder=class_folder, group=group_of.get(class_folder, ""),
                                        path=paths.get(class_folder, class_folder))
        where.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            file = pattern.format(folder=class_folder, lower=class_folder.lower(), first=class_folder[0], i=i,
                                  n=counter.next()) + ext
            (where / file).write_bytes(image_bytes(counter.next(), ext))
            tests += [file] if i == per_class - 1 else []
    if spec.name == "MLRSNet":   # the multi-label table of each category, as released
        (top / "Labels").mkdir(exist_ok=True)
        for class_folder in spec.classes:
            (top / "Labels" / f"{class_folder}.csv").write_text("image,airplane,airport\n")
    if split_list and spec.name in SPLIT_LISTS:
        (top / SPLIT_LISTS[spec.name]).resolve().write_text("\n".join(tests) + "\n")
    return top


def _write_captions(spec: SetSpec, root: Path, count: int, folder: str | None) -> Path:
    top_name, json_name, image_dir, ext = CAPTIONS[spec.name]
    top = root / (folder or top_name)
    (top / image_dir).mkdir(parents=True, exist_ok=True)
    images, counter = [], _Counter()
    for i in range(count):
        filename = f"{i + 1}{ext}" if spec.name.endswith("captions") else f"scene_{i + 1}{ext}"
        (top / image_dir / filename).write_bytes(image_bytes(counter.next(), ext))
        images.append({"filename": filename, "imgid": i, "split": "test" if i % 2 else "train",
                       "sentences": [{"raw": f"caption {k} of image {i + 1} .", "imgid": i, "sentid": 2 * i + k}
                                     for k in range(2)]})
    (top / json_name).write_text(json.dumps({"images": images, "dataset": spec.name.lower()}))
    return top


def write_suite(root: str | Path, names: list[str] | None = None, per_class: int = 1) -> dict[str, Path]:
    """Every named set (default: all of the catalog) under ``root``; name -> top folder."""
    names = names or [*LAYOUTS, *CAPTIONS]
    return {name: write_set(name, root, per_class) for name in names}
