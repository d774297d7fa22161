"""report.html for a 10,000-image set: its size and the time to write it.

    python -m benchmarks.eval_report --out benchmarks/results/eval_report.json     # ~1 min on 2 cores
    python -m benchmarks.eval_report --out /tmp/r.json --images 500 --classes 10 --retrieval-images 100 --repeats 1

A synthetic suite folder, written per the per-sample contract (docs/reference/file-formats.md):
a zero-shot set of --images JPEGs (256 px, q90, textured so that a thumbnail costs what a real scene
costs) in --classes classes, with a realistic confusion pattern (classes in groups of three similar
ones, e.g. dense / medium / sparse residential: most mistakes stay inside the group), and a
retrieval set of --retrieval-images images x 5 captions, ranked from random embeddings with the
caption near its image. Then `write_html_report` is timed (best of --repeats, a fresh thumbnail
cache each time: every image of the galleries decoded and encoded again), and the JSON records the
page's bytes (the thumbnail map apart), the thumbnails embedded, the per-sample files' bytes and the
machine; and the evaluation's own added cost, the per-sample rows computed from embeddings of those
sizes and written (`rows_cost`).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import PIL
from PIL import Image

from benchmarks.harness import base_parser, environment, write_report
from rsclip_ds.evaluation.html_report import Gallery, write_html_report

GROUP = 3          # classes per group of look-alikes


def texture(rng: np.random.Generator, base: np.ndarray, px: int) -> Image.Image:
    """A scene-like image: the class colour, a coarse random layout and fine noise."""
    coarse = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    layout = np.asarray(Image.fromarray(coarse).resize((px, px), Image.BILINEAR), dtype=np.float32)
    noise = rng.normal(0, 18, (px, px, 3))
    pixels = 0.5 * base + 0.4 * layout + noise                                   # (px, px, 3)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_images(folder: Path, count: int, colours: np.ndarray, labels: np.ndarray, px: int, seed: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        path = folder / f"{i:06d}.jpg"
        texture(rng, colours[labels[i]], px).save(path, "JPEG", quality=90)
        paths.append(str(path))
    return paths


def classification(folder: Path, n: int, classes: int, px: int, seed: int) -> tuple[dict, list[dict]]:
    """-> the suite.json record and the per-image rows. Logits: noise, +3 on the true class, +1.6
    on its group mates: ~70% top-1, most mistakes inside the group."""
    rng = np.random.default_rng(seed)
    names = [f"class {c:02d} ({['dense', 'medium', 'sparse'][c % GROUP]} land use {c // GROUP})" for c in range(classes)]
    labels = np.arange(n) % classes
    rng.shuffle(labels)
    group = np.arange(classes) // GROUP
    logits = rng.normal(0, 1, (n, classes)) + 1.6 * (group[None, :] == group[labels][:, None])   # (N, C)
    logits[np.arange(n), labels] += 1.4
    order = np.argsort(-logits, axis=1)                                          # (N, C) best first
    rank = np.argmax(order == labels[:, None], axis=1) + 1                       # (N,) 1-based
    scores = np.round(0.25 + 0.03 * np.take_along_axis(logits, order[:, :5], axis=1), 4)
    paths = write_images(folder, n, rng.integers(0, 255, (classes, 3)).astype(np.float32), labels, px, seed)
    rows = [{"image": paths[i], "label": int(labels[i]), "label_name": names[labels[i]], "readable": True,
             "rank": int(rank[i]), "top5": order[i, :5].tolist(), "top5_names": [names[c] for c in order[i, :5]],
             "top5_scores": scores[i].tolist(), "error": None} for i in range(n)]
    per_class = {names[c]: float((rank[labels == c] == 1).mean()) for c in range(classes)}
    record = {"name": "synthetic-classes", "root": str(folder), "split": "all images", "known": False, "warnings": [],
              "protocol": "zero-shot classification", "images": n, "classes": classes,
              "class_phrases": {f"c{c:02d}": names[c] for c in range(classes)}, "templates": ["a satellite photo of {}."],
              "top1": float((rank == 1).mean()), "top5": float((rank <= 5).mean()),
              "mean_per_class": float(np.mean(list(per_class.values()))), "per_class": per_class,
              "skipped_images": 0, "samples": "samples/synthetic-classes.zero-shot.jsonl"}
    return record, rows


def retrieval(folder: Path, n: int, per_image: int, px: int, seed: int) -> tuple[dict, list[dict]]:
    """-> the record and the rows: captions, then images. Embeddings: a caption = its image's + noise."""
    rng = np.random.default_rng(seed + 1)
    image_emb = rng.normal(0, 1, (n, 64)).astype(np.float32)                     # (I, D)
    owner = np.repeat(np.arange(n), per_image)                                   # (T,) caption -> image
    text_emb = image_emb[owner] + rng.normal(0, 2.2, (len(owner), 64)).astype(np.float32)
    sims = text_emb @ image_emb.T / 64                                           # (T, I)
    own = sims[np.arange(len(owner)), owner]
    t2i_rank = (sims > own[:, None]).sum(axis=1) + 1                             # (T,)
    t2i_top = np.argsort(-sims, axis=1)[:, :5]                                   # (T, 5)
    own_best = np.full(n, -np.inf, dtype=np.float32)                             # (I,) best own caption
    np.maximum.at(own_best, owner, own)
    i2t_rank = (sims.T > own_best[:, None]).sum(axis=1) + 1                      # (I,)
    i2t_top = np.argsort(-sims.T, axis=1)[:, :5]                                 # (I, 5)
    words = ["buildings", "a river", "farmland", "a road", "trees", "a harbour", "planes", "a meadow"]
    captions = [f"{words[(i * 7 + k) % 8]} next to {words[(i * 3 + 2 * k + 1) % 8]}, scene {i}" for i, k in
                zip(owner, np.tile(np.arange(per_image), n))]
    paths = write_images(folder, n, rng.integers(0, 255, (8, 3)).astype(np.float32), np.arange(n) % 8, px, seed)
    rows = [{"query": "caption", "caption_index": t, "caption": captions[t], "image_index": int(owner[t]),
             "image": paths[owner[t]], "readable": True, "rank": int(t2i_rank[t]), "top5": t2i_top[t].tolist(),
             "top5_images": [paths[i] for i in t2i_top[t]], "top5_scores": np.round(sims[t, t2i_top[t]], 4).tolist()}
            for t in range(len(owner))]
    rows += [{"query": "image", "image_index": i, "image": paths[i], "readable": True, "rank": int(i2t_rank[i]),
              "top5": i2t_top[i].tolist(), "top5_captions": [captions[t] for t in i2t_top[i]],
              "top5_scores": np.round(sims[i2t_top[i], i], 4).tolist(),
              "captions": list(range(i * per_image, (i + 1) * per_image)), "error": None} for i in range(n)]
    recall = {f"{d}_R@{k}": float((r <= k).mean()) for d, r in (("i2t", i2t_rank), ("t2i", t2i_rank)) for k in (1, 5, 10)}
    record = {"name": "synthetic-captions", "root": str(folder), "split": "all images", "known": False, "warnings": [],
              "protocol": "retrieval", "images": n, "captions": len(owner), **recall,
              "mean_recall": float(np.mean(list(recall.values()))), "skipped_images": 0, "skipped_captions": 0,
              "samples": "samples/synthetic-captions.retrieval.jsonl"}
    return record, rows


def write_suite(out: Path, records: list[dict], rows: list[list[dict]]) -> int:
    """suite.json + samples/*.jsonl -> the samples' bytes."""
    (out / "samples").mkdir(parents=True, exist_ok=True)
    size = 0
    for record, rs in zip(records, rows):
        path = out / record["samples"]
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rs), encoding="utf-8")
        size += path.stat().st_size
    suite = {"template_set": "git-rsclip", "template_source": "synthetic", "sets": records, "model": "synthetic",
             "source": "benchmarks/eval_report.py", "step": 0, "unrecognised": [], "published": []}
    (out / "suite.json").write_text(json.dumps(suite, indent=2), encoding="utf-8")
    return size


def rows_cost(images: int, classes: int, retrieval_images: int, per_image: int, dim: int, seed: int) -> dict:
    """The evaluation's own part: the per-sample rows from the embeddings it already has (samples.py, what
    `rsclip-ds eval` and the training hook add to each evaluation) and their JSON Lines, timed on random
    unit embeddings of the sizes above (`dim`: git-rsclip-base's 768)."""
    import torch

    from rsclip_ds.evaluation.samples import classification_rows, retrieval_rows, write_rows

    g = torch.Generator().manual_seed(seed)
    unit = lambda n: torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=1)   # noqa: E731
    labels = torch.randint(0, classes, (images,), generator=g).tolist()
    names = [f"class {c}" for c in range(classes)]
    captions = [f"caption {i}" for i in range(retrieval_images * per_image)]
    index = [i // per_image for i in range(len(captions))]
    image_emb, class_emb, r_images, r_texts = unit(images), unit(classes), unit(retrieval_images), unit(len(captions))
    with tempfile.TemporaryDirectory(prefix="eval_rows_") as tmp:
        t0 = time.perf_counter()
        cls = classification_rows([f"/x/{i}.jpg" for i in range(images)], labels, names,
                                  torch.ones(images, dtype=torch.bool), image_emb, class_emb)
        t1 = time.perf_counter()
        ret = retrieval_rows([f"/x/r{i}.jpg" for i in range(retrieval_images)], captions, index,
                             torch.ones(retrieval_images, dtype=torch.bool), r_images, r_texts)
        t2 = time.perf_counter()
        write_rows(Path(tmp) / "a.jsonl", cls)
        write_rows(Path(tmp) / "b.jsonl", ret)
        t3 = time.perf_counter()
    return {"dim": dim, "classification_s": t1 - t0, "retrieval_s": t2 - t1, "write_s": t3 - t2,
            "total_s": t3 - t0}


def measure(out: Path, repeats: int, gallery: Gallery) -> dict:
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        path = write_html_report(out, gallery)
        seconds.append(time.perf_counter() - t0)
    page = path.read_text(encoding="utf-8")
    thumbs = json.loads(re.search(r'<script type="application/json" id="thumbs">(.*?)</script>', page, re.S).group(1))
    map_bytes = len(json.dumps(thumbs).encode())
    return {"seconds_best": min(seconds), "seconds": seconds, "bytes": path.stat().st_size,
            "thumbnail_map_bytes": map_bytes, "rest_bytes": path.stat().st_size - map_bytes,
            "thumbnails": len(thumbs) - 1,   # the map's entries less the placeholder
            "img_elements": page.count("<img data-thumb="),
            "confusion_cells": page.count("<td data-true=")}


def print_tables(report: dict) -> None:
    r, c = report["report"], report["config"]
    print(f"report.html for {c['images']} images / {c['classes']} classes + {c['retrieval_images']} x "
          f"{c['captions_per_image']} captions: {r['bytes'] / 1e6:.2f} MB ({r['thumbnails']} thumbnails, "
          f"{r['thumbnail_map_bytes'] / 1e6:.2f} MB of them), written in {r['seconds_best']:.2f} s "
          f"(best of {len(r['seconds'])}); per-sample files {report['samples_bytes'] / 1e6:.1f} MB")
    if "rows" in report:
        w = report["rows"]
        print(f"per-sample rows from the embeddings: {w['classification_s']:.2f} s zero-shot, {w['retrieval_s']:.2f} s "
              f"retrieval, {w['write_s']:.2f} s to write ({w['total_s']:.2f} s in all)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = base_parser(__doc__)
    parser.add_argument("--images", type=int, default=10_000, help="classification images")
    parser.add_argument("--classes", type=int, default=45)
    parser.add_argument("--retrieval-images", type=int, default=2_000)
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--px", type=int, default=256, help="side of the synthetic JPEGs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    gallery = Gallery()
    with tempfile.TemporaryDirectory(prefix="eval_report_") as tmp:
        t0 = time.perf_counter()
        cls_record, cls_rows = classification(Path(tmp) / "classes", args.images, args.classes, args.px, args.seed)
        ret_record, ret_rows = retrieval(Path(tmp) / "captions", args.retrieval_images, args.captions_per_image,
                                         args.px, args.seed)
        out = Path(tmp) / "suite"
        samples_bytes = write_suite(out, [cls_record, ret_record], [cls_rows, ret_rows])
        setup = time.perf_counter() - t0
        result = measure(out, args.repeats, gallery)
    rows = rows_cost(args.images, args.classes, args.retrieval_images, args.captions_per_image, 768, args.seed)
    report = {"config": {"images": args.images, "classes": args.classes, "retrieval_images": args.retrieval_images,
                         "captions_per_image": args.captions_per_image, "px": args.px, "repeats": args.repeats,
                         "seed": args.seed, "gallery": asdict(gallery)},
              "environment": environment(args.threads, platform=platform.platform(), machine=platform.machine(),
                                         pillow=PIL.__version__,
                                         numpy=np.__version__),
              "metrics": {"top1": cls_record["top1"], "mean_recall": ret_record["mean_recall"]},
              "samples_bytes": samples_bytes, "setup_seconds": setup, "report": result, "rows": rows}
    write_report(report, args.out, print_tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
