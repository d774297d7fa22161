"""Per-sample results of an evaluation: what the model said about each image and each caption.

The metrics (metrics.py) reduce a set to a few numbers; these rows keep what they were computed from, so
that a person can see which classes are confused and which captions find the wrong scene, without
embedding anything again (report.html: html_report.py; TensorBoard and W&B: reporting/eval_visuals.py).
They come from the embeddings the metrics already used: no second forward pass.

    rows = classification_rows(cs.paths, cs.labels, cs.class_names, ok, image_emb, classes, errors)
    write_rows(folder / "samples" / sample_file("AID", "zero-shot"), rows)
    pandas.read_json(path, lines=True)                        # one row per image (or query)

A zero-shot row per image, in the set's order (unreadable ones too, `readable: false`):
`image`, `label`, `label_name`, `readable`, `rank` (1-based rank of the true class; ties count against the
model, as in metrics.py), `top5` (class indices, best first), `top5_names`, `top5_scores` (cosine of the
image and class embeddings), `error`. A retrieval set gives a row per caption query (`query: "caption"`:
the rank of its image among the images, the top-5 images) and then one per image query (`query: "image"`:
the rank of its first correct caption, the top-5 captions, its own captions). Indices are into the set's
full lists; ranks and top-5 run over the readable items. docs/reference/file-formats.md has every field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

import torch

from rsclip_ds.evaluation.metrics import rank_of_correct

TOP = 5
KINDS = ("zero-shot", "retrieval")


def sample_file(set_name: str, kind: str) -> str:
    """The samples file of one set: '<set>.<kind>.jsonl', the name safe on any file system."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {KINDS}")
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', set_name)}.{kind}.jsonl"


def _top(scores: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """(Q, K) scores -> per row the indices and scores of the k best, best first."""
    values, indices = scores.topk(min(k, scores.shape[1]), dim=1)
    return indices.tolist(), [[round(v, 4) for v in row] for row in values.tolist()]


def classification_rows(paths: Sequence, labels: Sequence[int], class_names: Sequence[str], ok: torch.Tensor,
                        image_emb: torch.Tensor, class_emb: torch.Tensor,
                        errors: dict[int, str] | None = None) -> list[dict]:
    """One row per image of a zero-shot set. image_emb (N, D) of every image (zeros where unreadable), class_emb
    (C, D), ok (N,) bool: readable; errors: image index -> why it could not be read (where this rank knows)."""
    errors = errors or {}
    labels_t = torch.as_tensor(list(labels), dtype=torch.long)
    keep = ok.nonzero().flatten()
    scores = image_emb[keep].float() @ class_emb.float().T                          # (N_ok, C)
    correct = torch.nn.functional.one_hot(labels_t[keep], len(class_names)).bool()  # (N_ok, C)
    ranks = (rank_of_correct(scores, correct) + 1).tolist()
    top, top_scores = _top(scores, TOP)
    read = dict(zip(keep.tolist(), range(len(keep))))   # image index -> row among the readable
    rows = []
    for i, (path, label) in enumerate(zip(paths, labels)):
        j = read.get(i)
        rows.append({"image": str(path), "label": int(label), "label_name": class_names[label],
                     "readable": j is not None, "rank": ranks[j] if j is not None else None,
                     "top5": top[j] if j is not None else [],
                     "top5_names": [class_names[c] for c in top[j]] if j is not None else [],
                     "top5_scores": top_scores[j] if j is not None else [], "error": errors.get(i)})
    return rows


def retrieval_rows(image_paths: Sequence, captions: Sequence[str], text_image_index: Sequence[int],
                   ok: torch.Tensor, image_emb: torch.Tensor, text_emb: torch.Tensor,
                   errors: dict[int, str] | None = None) -> list[dict]:
    """A row per caption query, then a row per image query, of one caption set. image_emb (N, D) and text_emb
    (M, D) of every image and caption, ok (N,) bool: the image was read (its captions count only then)."""
    errors = errors or {}
    index = torch.as_tensor(list(text_image_index), dtype=torch.long)
    images = ok.nonzero().flatten()                        # readable image -> its index in the set
    texts = ok[index].nonzero().flatten()                  # captions of readable images
    new_index = torch.cumsum(ok.long(), 0) - 1             # image index -> index among the readable
    sim = image_emb[images].float() @ text_emb[texts].float().T                           # (N_ok, M_ok)
    owns = new_index[index[texts]][None, :] == torch.arange(len(images))[:, None]       # (N_ok, M_ok)
    t2i, i2t = (rank_of_correct(sim.T, owns.T) + 1).tolist(), (rank_of_correct(sim, owns) + 1).tolist()
    t_top, t_scores = _top(sim.T, TOP)
    i_top, i_scores = _top(sim, TOP)
    img_list, txt_list = images.tolist(), texts.tolist()
    caption_row = dict(zip(txt_list, range(len(txt_list))))
    image_row = dict(zip(img_list, range(len(img_list))))
    own: dict[int, list[int]] = {}
    for j, i in enumerate(index.tolist()):
        own.setdefault(i, []).append(j)
    rows = []
    for j, (caption, i) in enumerate(zip(captions, index.tolist())):
        q = caption_row.get(j)
        top = [img_list[c] for c in t_top[q]] if q is not None else []
        rows.append({"query": "caption", "caption_index": j, "caption": caption, "image_index": i,
                     "image": str(image_paths[i]), "readable": q is not None,
                     "rank": t2i[q] if q is not None else None, "top5": top,
                     "top5_images": [str(image_paths[t]) for t in top],
                     "top5_scores": t_scores[q] if q is not None else []})
    for i, path in enumerate(image_paths):
        q = image_row.get(i)
        top = [txt_list[c] for c in i_top[q]] if q is not None else []
        rows.append({"query": "image", "image_index": i, "image": str(path), "readable": q is not None,
                     "rank": i2t[q] if q is not None else None, "top5": top,
                     "top5_captions": [captions[t] for t in top], "top5_scores": i_scores[q] if q is not None else [],
                     "captions": own.get(i, []), "error": errors.get(i)})
    return rows


def unreadable_errors(embedder, paths: Sequence) -> dict[int, str]:
    """image index -> why it could not be read, for the images this rank read (Embedder.unreadable of the
    last embed(); the others' reasons stayed on their ranks: the gathered mask says only *that*)."""
    where = {str(p): i for i, p in enumerate(paths)}
    return {where[str(p)]: error for p, error in embedder.unreadable if str(p) in where}


def write_rows(path: Path, rows: list[dict]) -> Path:
    """JSON Lines, UTF-8, non-ASCII kept as is; written to a .partial file and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    partial.replace(path)
    return path


def read_rows(path: Path) -> list[dict]:
    """One JSON object per line (UTF-8); a bad line fails naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: not a JSON object ({err})") from err
    return rows


def write_samples(named: list[tuple[str, str, dict]], folder: Path, relative_to: Path | None = None) -> list[Path]:
    """(set name, kind, record) -> the record's rows (its `rows` key: rank 0's) in folder/samples/<set>.<kind>.jsonl;
    the record keeps the file's path (relative to `relative_to`, default `folder`) as "samples" instead."""
    written = []
    for name, kind, record in named:
        rows = record.pop("rows", None)
        if rows is None:
            continue
        path = write_rows(folder / "samples" / sample_file(name, kind), rows)
        record["samples"] = str(path.relative_to(relative_to or folder))
        written.append(path)
    return written
