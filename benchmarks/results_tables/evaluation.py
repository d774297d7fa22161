"""Sections of docs/results/evaluation.md: benchmarks/eval_report.py (what the per-sample results and
report.html cost on a 10,000-image set)."""

from __future__ import annotations

from benchmarks.results_tables.format import fix, sig, table


def report(files: dict) -> list[str]:
    """The report's size (its thumbnails apart) and the time to write it; the per-sample files' size; and the
    evaluation's own added cost, the rows computed from its embeddings and written."""
    rep = files["eval_report.json"]
    c, r = rep["config"], rep["report"]
    out = [f"A synthetic suite folder: {sig(c['images'])} images in {c['classes']} classes (zero-shot) and "
           f"{sig(c['retrieval_images'])} images x {c['captions_per_image']} captions (retrieval), {c['px']} px "
           f"JPEGs; galleries capped at {c['gallery']['max_pairs']} confused pairs x {c['gallery']['per_pair']} "
           f"images and {c['gallery']['max_queries']} queries per list, {c['gallery']['thumb_px']} px thumbnails. "
           f"`write_html_report` best of {len(r['seconds'])}.", ""]
    out += table(["report.html", "of it thumbnails", "thumbnails", "confusion cells", "written in s",
                  "per-sample files"],
                 [[f"{sig(r['bytes'] / 1e6)} MB", f"{sig(r['thumbnail_map_bytes'] / 1e6)} MB", r["thumbnails"],
                   sig(r["confusion_cells"]), fix(r["seconds_best"]), f"{sig(rep['samples_bytes'] / 1e6)} MB"]])
    if "rows" in rep:
        w = rep["rows"]
        out += [f"What an evaluation adds to make them (no second forward pass): the rows from the embeddings it "
                f"already has ({w['dim']}-d), and their JSON Lines:", ""]
        out += table(["zero-shot rows s", "retrieval rows s", "write s", "in all s"],
                     [[fix(w["classification_s"]), fix(w["retrieval_s"]), fix(w["write_s"]), fix(w["total_s"])]])
    return out
