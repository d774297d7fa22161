"""A suite folder written by hand per the per-sample contract (suite.json + samples/*.jsonl + real
PNGs), with known confusions, for tests/unit/test_html_report.py and the browser test.

    facts = make_suite(tmp_path / "suite")     # -> the constants below, plus the paths

UCM (zero-shot classification, 7 classes):
    dense residential   5 images: 3 right, 2 taken for medium residential (one of those files is
                        deleted after the samples were written: cannot be opened at report time)
    medium residential  4 images: 3 right, 1 taken for dense residential
    meadow              4 images: 3 right, 1 taken for farmland
    farmland            3 right;  airport 2 right + 1 unreadable;  港口 (harbour) 2 right
    empty class         no images
RSICD (retrieval): 5 images x 2 captions (some Chinese); image 4 unreadable. Caption ranks below;
caption 3 is ranked worst (4). one-image (retrieval): one image, one caption.
AID: a set that failed ("error", no samples file). compare: a second model on UCM and RSICD.
"""

from __future__ import annotations

import colorsys
import json
from pathlib import Path

from PIL import Image

PHRASES = {"denseresidential": "dense residential", "mediumresidential": "medium residential",
           "meadow": "meadow", "farmland": "farmland", "airport": "airport", "harbor": "港口",
           "emptyclass": "empty class"}
NAMES = list(PHRASES.values())
# (true, predicted top-1) per readable image, in set order; None: unreadable
OUTCOMES = ([(0, 0)] * 3 + [(0, 1)] * 2 + [(1, 1)] * 3 + [(1, 0)] + [(2, 2)] * 3 + [(2, 3)] + [(3, 3)] * 3
            + [(4, 4)] * 2 + [(4, None)] + [(5, 5)] * 2)
CONFUSIONS = {("dense residential", "medium residential"): 2, ("medium residential", "dense residential"): 1,
              ("meadow", "farmland"): 1}
DIAGONAL = {"dense residential": 3, "medium residential": 3, "meadow": 3, "farmland": 3, "airport": 2, "港口": 2,
            "empty class": 0}
ORDER = ["dense residential", "medium residential", "farmland", "meadow", "airport", "empty class", "港口"]
ACCURACY = {"dense residential": "60.00", "medium residential": "75.00", "meadow": "75.00", "farmland": "100.00",
            "airport": "100.00", "港口": "100.00", "empty class": "—"}
WORST_FIRST = ["dense residential", "meadow", "medium residential", "airport", "farmland", "港口", "empty class"]
# compared model's per-class top-1: dense +40 points, 港口 +50, farmland +33.33, meadow -25
THEIR_PER_CLASS = {"dense residential": 0.2, "medium residential": 0.75, "meadow": 1.0, "farmland": 2 / 3,
                   "airport": 1.0, "港口": 0.5}
CAPTIONS = ["many dense buildings beside a road", "许多建筑物和绿树", "a green meadow", "a river crosses farmland",
            "planes & <i>jets</i> at an airport", "飞机停在机场", "ships in a harbour", "港口里有几艘船",
            "a broken image", "another caption of the broken image"]
CAPTION_RANKS = [1, 2, 1, 4, 1, 3, 1, 2]          # captions 0..7 (8, 9: of the unreadable image 4)
IMAGE_RANKS = [1, 3, 1, 2]                         # images 0..3
WORST_CAPTION = 3


def _png(path: Path, colour: tuple[int, int, int], size=(40, 30)) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return str(path)


def _colour(i: int) -> tuple[int, int, int]:
    """Distinct colours: hues a golden-ratio step apart."""
    r, g, b = colorsys.hsv_to_rgb((0.618034 * i) % 1.0, 0.65, 0.85)
    return int(255 * r), int(255 * g), int(255 * b)


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def _ranked(first: int, others: list[int], rank: int) -> list[int]:
    """Indices best first with `first` at 1-based `rank` (the others fill in, in order)."""
    rest = [o for o in others if o != first]
    return rest[:rank - 1] + [first] + rest[rank - 1:]


def classification_rows(root: Path) -> tuple[list[dict], str]:
    """-> the rows and the image deleted afterwards (cannot be opened at report time)."""
    rows, gone = [], None
    for n, (label, pred) in enumerate(OUTCOMES):
        path = _png(root / "UCM" / f"{list(PHRASES)[label]}_{n:02d}.png", _colour(n))
        if pred is None:   # unreadable at evaluation time
            rows.append({"image": path, "label": label, "label_name": NAMES[label], "readable": False, "rank": None,
                         "top5": [], "top5_names": [], "top5_scores": [],
                         "error": "UnidentifiedImageError: cannot identify image file"})
            continue
        top5 = ([pred] + ([label] if label != pred else []) + [c for c in range(len(NAMES)) if c not in (label, pred)])[:5]
        scores = [round(0.40 - 0.03 * k - 0.001 * n, 4) for k in range(5)]
        if (label, pred) == (0, 1) and gone is None:
            gone, scores[0] = path, 0.45    # the surest mistake: shown in the gallery, then deleted
        rows.append({"image": path, "label": label, "label_name": NAMES[label], "readable": True,
                     "rank": top5.index(label) + 1, "top5": top5, "top5_names": [NAMES[c] for c in top5],
                     "top5_scores": scores, "error": None})
    return rows, gone


def retrieval_rows(root: Path) -> list[dict]:
    images = [_png(root / "RSICD" / f"scene_{i}.jpg.png", _colour(40 + i), (30, 30)) for i in range(5)]
    readable = [0, 1, 2, 3]
    rows = []
    for c, caption in enumerate(CAPTIONS):
        image = c // 2
        row = {"query": "caption", "caption_index": c, "caption": caption, "image_index": image,
               "image": images[image], "readable": image in readable}
        if image in readable:
            top5 = _ranked(image, readable, CAPTION_RANKS[c])
            row.update(rank=CAPTION_RANKS[c], top5=top5, top5_images=[images[i] for i in top5],
                       top5_scores=[round(0.3 - 0.02 * k, 4) for k in range(len(top5))])
        else:
            row.update(rank=None, top5=[], top5_images=[], top5_scores=[])
        rows.append(row)
    scored = [c for c in range(len(CAPTIONS)) if c // 2 in readable]
    for i in range(5):
        row = {"query": "image", "image_index": i, "image": images[i], "readable": i in readable,
               "captions": [2 * i, 2 * i + 1], "error": None}
        if i in readable:
            top5 = _ranked(2 * i, scored, IMAGE_RANKS[i])[:5]
            row.update(rank=IMAGE_RANKS[i], top5=top5, top5_captions=[CAPTIONS[c] for c in top5],
                       top5_scores=[round(0.3 - 0.02 * k, 4) for k in range(5)])
        else:
            row.update(rank=None, top5=[], top5_captions=[], top5_scores=[], error="OSError: image file is truncated")
        rows.append(row)
    return rows


def single_rows(root: Path) -> list[dict]:
    image = _png(root / "one" / "only.png", (200, 30, 30))
    return [{"query": "caption", "caption_index": 0, "caption": "the only scene", "image_index": 0, "image": image,
             "readable": True, "rank": 1, "top5": [0], "top5_images": [image], "top5_scores": [0.21]},
            {"query": "image", "image_index": 0, "image": image, "readable": True, "rank": 1, "top5": [0],
             "top5_captions": ["the only scene"], "top5_scores": [0.21], "captions": [0], "error": None}]


def _base(name: str, protocol: str, root: Path) -> dict:
    return {"name": name, "root": str(root / name), "split": "all images", "known": True, "warnings": [],
            "protocol": protocol}


def make_suite(out: Path, images: Path | None = None, compare: bool = True) -> dict:
    """Write the suite folder `out` (images under `images`, default out.parent / "images")."""
    images = images or out.parent / "images"
    cls_rows, gone = classification_rows(images)
    ret_rows, one_rows = retrieval_rows(images), single_rows(images)
    _jsonl(out / "samples" / "UCM.zero-shot.jsonl", cls_rows)
    _jsonl(out / "samples" / "RSICD.retrieval.jsonl", ret_rows)
    _jsonl(out / "samples" / "one-image.retrieval.jsonl", one_rows)
    Path(gone).unlink()                       # cannot be opened at report time: a placeholder
    per_class = {n: DIAGONAL[n] / sum(1 for t, p in OUTCOMES if p is not None and NAMES[t] == n)
                 for n in NAMES if n != "empty class"}
    ucm = {**_base("UCM", "zero-shot classification", images), "images": 21, "classes": 7,
           "class_phrases": PHRASES, "templates": ["a satellite photo of {}."], "top1": 16 / 21, "top5": 1.0,
           "mean_per_class": sum(per_class.values()) / len(per_class), "per_class": per_class,
           "skipped_images": 1, "samples": "samples/UCM.zero-shot.jsonl"}
    rsicd = {**_base("RSICD", "retrieval", images), "images": 4, "captions": 8,
             "i2t_R@1": 0.5, "i2t_R@5": 1.0, "i2t_R@10": 1.0, "t2i_R@1": 0.5, "t2i_R@5": 1.0, "t2i_R@10": 1.0,
             "mean_recall": 5 / 6, "skipped_images": 1, "skipped_captions": 2,
             "samples": "samples/RSICD.retrieval.jsonl"}
    one = {**_base("one-image", "retrieval", images), "images": 1, "captions": 1,
           **{k: 1.0 for k in ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "mean_recall")},
           "skipped_images": 0, "skipped_captions": 0, "samples": "samples/one-image.retrieval.jsonl"}
    aid = {**_base("AID", "zero-shot classification", images),
           "error": "21 of 40 images unreadable (52.5%), more than max_bad_fraction 1%"}
    suite = {"template_set": "git-rsclip", "template_source": "Git-RSCLIP's paper, table 9", "sets": [ucm, aid, rsicd, one],
             "model": "runs/tiny/checkpoints/step00000200", "source": "runs/tiny/checkpoints/step00000200",
             "step": 200, "unrecognised": ["notes"],
             "published": [{"model": "RemoteCLIP ViT-L-14", "set": "UCM", "metric": "top1", "value": 0.7,
                            "source": "https://example.org/remoteclip table 3", "verified": True, "note": ""},
                           {"model": "Git-RSCLIP", "set": "RSICD", "metric": "mean_recall", "value": 35.5,
                            "source": "https://example.org/git-rsclip table 4", "verified": True, "note": ""}]}
    if compare:
        theirs_ucm = {k: v for k, v in ucm.items() if k != "samples"}
        theirs_ucm.update(top1=0.5, top5=0.9, per_class=THEIR_PER_CLASS,
                          mean_per_class=sum(THEIR_PER_CLASS.values()) / len(THEIR_PER_CLASS))
        theirs_rsicd = {k: v for k, v in rsicd.items() if k != "samples"}
        theirs_rsicd.update(mean_recall=0.3, **{"t2i_R@1": 0.25, "i2t_R@1": 0.25})
        suite["compare"] = {"model": "hub/RemoteCLIP-ViT-B-32", "source": "hub/RemoteCLIP-ViT-B-32",
                            "template_set": "git-rsclip", "sets": [theirs_ucm, aid, theirs_rsicd]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(suite, indent=2, ensure_ascii=False), encoding="utf-8")
    return {"dir": out, "missing_image": gone, "suite": suite}
