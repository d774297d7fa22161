"""The remote-sensing benchmark suite: every standard set found under a root (catalog.find_sets),
evaluated through one Embedder with a named template set.

    found, unrecognised = find_sets(root)                     # the CLI's and the hook's job
    results = evaluate_suite(found, embedder, load_template_set("git-rsclip"))
    results["sets"][0] -> {"name": "WHU-RS19", "protocol": "zero-shot classification",
                           "split": "all images", "images": 1005, "class_phrases": {...},
                           "top1": ..., "top5": ..., "mean_per_class": ...}

Distributed: every rank calls evaluate_suite with the same sets in the same order; each set's
embed() splits the items over the ranks and all-gathers them (through the model's forward, so
ZeRO-3's parameter gathers see every rank), so every rank computes the same numbers. A set with
too many unreadable images (DataError, decided on the gathered marks, the same on every rank) is
recorded with its error and the suite goes on.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from rsclip_ds.data.bad import DataError
from rsclip_ds.evaluation.catalog import CLASSIFICATION, RETRIEVAL, FoundSet
from rsclip_ds.evaluation.datasets import CaptionSet, ClassFolderSet, EvalSets
from rsclip_ds.evaluation.embed import Embedder, _readable, class_embeddings, evaluate
from rsclip_ds.evaluation.metrics import zero_shot_metrics
from rsclip_ds.evaluation.prompts import TemplateSet
from rsclip_ds.evaluation.samples import classification_rows, unreadable_errors

log = logging.getLogger("rsclip_ds")
RETRIEVAL_KEYS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "mean_recall")


def evaluate_suite(found: Iterable[FoundSet], embedder: Embedder, templates: TemplateSet,
                   max_bad_fraction: float = 0.01, keep_logits: bool = False, samples: bool = False) -> dict:
    """-> {"template_set", "template_source", "sets": [one record per set and protocol, in order]}.
    Fractions in [0, 1]. ``keep_logits``: classification records also hold "logits" (N, C), the
    model's exp(t) cos + b for every scored image and class (for comparisons; large). ``samples``: on
    rank 0, each scored record also holds "rows", its per-sample results (samples.py; write_report
    writes them to samples/ and keeps the file's name)."""
    records = []
    for s in found:
        base = {"name": s.name, "root": str(s.root), "split": s.split, "known": s.spec is not None,
                "warnings": list(s.warnings)}
        if s.classification is None and s.retrieval is None:
            raise ValueError(f"found set {s.name} ({s.root}) holds neither a class-folder nor a caption set")
        if s.classification is not None:
            records.append(_guarded(base, CLASSIFICATION, embedder.rank, lambda: classify_set(
                embedder, s.classification, templates.for_set(s.name), s.name, max_bad_fraction, keep_logits,
                samples)))
        if s.retrieval is not None:
            records.append(_guarded(base, RETRIEVAL, embedder.rank, lambda: retrieve_set(
                embedder, s.retrieval, s.name, max_bad_fraction, samples)))
    return {"template_set": templates.name, "template_source": templates.source, "sets": records}


def _guarded(base: dict, protocol: str, rank: int, run) -> dict:
    if rank == 0:
        log.info("suite: %s, %s (%s)", base["name"], protocol, base["split"])
    try:
        return {**base, "protocol": protocol, **run()}
    except DataError as err:   # every rank counted the same gathered marks: all record it, all go on
        if rank == 0:
            log.error("suite: %s (%s) not scored: %s", base["name"], protocol, err)
        return {**base, "protocol": protocol, "error": str(err)}


def classify_set(embedder: Embedder, cs: ClassFolderSet, templates: list[str], name: str,
                 max_bad_fraction: float = 0.01, keep_logits: bool = False, samples: bool = False) -> dict:
    """Zero-shot classification of one class-folder set: the class embedding is the normalised
    mean over ``templates`` of the prompted phrase (cs.class_names are the phrases). ``samples``: rank 0's
    record holds "rows", a row per image (samples.classification_rows)."""
    what = f"{name} zero-shot"
    prompts = [t.format(phrase) for phrase in cs.class_names for t in templates]   # (C * T,) class-major
    image_emb, text_emb = embedder.embed(cs.paths, prompts, what)                  # (N, D), (C * T, D)
    ok = _readable(embedder, what, max_bad_fraction)                               # (N,) bool
    classes = class_embeddings(text_emb, len(cs.class_names), len(templates))      # (C, D)
    labels = torch.tensor(cs.labels)
    m = zero_shot_metrics(image_emb[ok], classes, labels[ok], cs.class_names)
    record = {"images": int(ok.sum()), "classes": len(cs.class_names),
              "class_phrases": dict(zip(cs.folders, cs.class_names)), "templates": list(templates),
              "top1": m["top1"], "top5": m["top5"], "mean_per_class": m["mean_per_class"],
              "per_class": m["per_class"], "skipped_images": int((~ok).sum())}
    if keep_logits:
        scale, bias = embedder.logit_scale, embedder.logit_bias
        record["logits"] = (image_emb[ok] @ classes.T * scale.exp() + bias).tolist()   # (N_ok, C)
    if samples and embedder.rank == 0:
        record["rows"] = classification_rows(cs.paths, cs.labels, cs.class_names, ok, image_emb, classes,
                                             unreadable_errors(embedder, cs.paths))
    return record


def retrieve_set(embedder: Embedder, rs: CaptionSet, name: str, max_bad_fraction: float = 0.01,
                 samples: bool = False) -> dict:
    """Image-text retrieval of one caption set (rsclip_ds.evaluation.embed.evaluate's)."""
    r = evaluate(embedder, EvalSets(retrieval=rs, max_bad_fraction=max_bad_fraction), samples=samples)["retrieval"]
    return {"images": r["num_images"], "captions": r["num_texts"], **{k: r[k] for k in RETRIEVAL_KEYS},
            "skipped_images": r["skipped_images"], "skipped_captions": r["skipped_captions"],
            **({"rows": r["rows"]} if "rows" in r else {})}


def sample_files(results: dict) -> list[tuple[str, str, dict]]:
    """(set name, samples kind, record) of every record that holds per-sample rows (samples.write_samples)."""
    return [(r["name"], "zero-shot" if r["protocol"] == CLASSIFICATION else "retrieval", r)
            for r in results["sets"] if "rows" in r]


def suite_metrics(results: dict) -> dict[str, float]:
    """{"suite/<set>/top1": ..., "suite/<set>/mean_recall": ...}: per set, for logs and monitors."""
    out = {}
    for r in results["sets"]:
        key = "top1" if r["protocol"] == CLASSIFICATION else "mean_recall"
        if key in r:
            out[f"suite/{r['name']}/{key}"] = float(r[key])
    return out
