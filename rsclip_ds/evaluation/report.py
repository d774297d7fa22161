"""The suite's report: a JSON, a markdown table and a PNG, with the published numbers beside ours.

    write_report(results, out_dir, published)   -> [suite.json, suite.md, suite.png]

``results`` is evaluate_suite's dict plus "model" (what was evaluated), "unrecognised" (folders
not recognised) and optionally "compare" ({"model", "sets"}: a second model on the same sets).
``published`` is a list of catalog.PublishedResult (catalog.published_results() in the CLI):
top-1 published as a fraction, mean recall in percent, as the tables print them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from rsclip_ds.evaluation.catalog import PublishedResult
from rsclip_ds.evaluation.published import DASH, FAMILIES, HEADLINE, pct, percent, published_value, short_model
from rsclip_ds.evaluation.html_report import write_html_report
from rsclip_ds.evaluation.samples import write_samples
from rsclip_ds.evaluation.suite import CLASSIFICATION, RETRIEVAL, RETRIEVAL_KEYS, sample_files

log = logging.getLogger("rsclip_ds")
def _row_published(published, name: str, protocol: str, used: dict) -> list[str]:
    cells = []
    for family in FAMILIES:
        p = published_value(published, family, name, protocol)
        if p is not None:
            used[(p.model, p.source)] = None
        cells.append(DASH if p is None else f"{percent(p):.2f}")
    return cells


def _by_name(sets: list[dict], protocol: str) -> dict[str, dict]:
    return {r["name"]: r for r in sets if r["protocol"] == protocol}


def markdown_report(results: dict, published: Sequence[PublishedResult]) -> str:
    """The two tables (zero-shot classification, retrieval; percent), the published models' sources,
    the class phrases that differ from the folder names (beyond case), and the folders not recognised."""
    compare = results.get("compare")
    other = _by_name(compare["sets"], CLASSIFICATION) if compare else {}
    other_r = _by_name(compare["sets"], RETRIEVAL) if compare else {}
    extra = [f"{short_model(compare['model'])} top-1"] if compare else []
    used: dict = {}
    lines = [f"# Remote-sensing benchmark suite: {results['model']}", "",
             f"Template set `{results['template_set']}`" + (f" ({results['template_source']})"
                                                          if results.get("template_source") else "") +
             ". Percent; published numbers beside ours where the model's paper or card has the set "
             f"({DASH}: not published).", ""]
    cls = [r for r in results["sets"] if r["protocol"] == CLASSIFICATION]
    if cls:
        head = ["set", "split", "images", "classes", "top-1", "top-5", "mean per class", *extra, *FAMILIES]
        lines += ["## Zero-shot classification", "", _md_row(head), _md_rule(head, 2)]
        for r in cls:
            ours = ([f"failed: {r['error'][:60]}", DASH, DASH] if "error" in r else
                    [pct(r["top1"]), pct(r["top5"]), pct(r["mean_per_class"])])
            theirs = [pct(other.get(r["name"], {}).get("top1"))] if compare else []
            lines.append(_md_row([r["name"], r["split"], str(r.get("images", DASH)), str(r.get("classes", DASH)),
                                  *ours, *theirs, *_row_published(published, r["name"], CLASSIFICATION, used)]))
        lines.append("")
    ret = [r for r in results["sets"] if r["protocol"] == RETRIEVAL]
    if ret:
        names = ["i2t R@1", "i2t R@5", "i2t R@10", "t2i R@1", "t2i R@5", "t2i R@10", "mean recall"]
        extra_r = [f"{short_model(compare['model'])} mean recall"] if compare else []
        head = ["set", "split", "images", "captions", *names, *extra_r, *FAMILIES]
        lines += ["## Retrieval", "", _md_row(head), _md_rule(head, 2)]
        for r in ret:
            ours = ([f"failed: {r['error'][:60]}"] + [DASH] * 6 if "error" in r else
                    [pct(r[k]) for k in RETRIEVAL_KEYS])
            theirs = [pct(other_r.get(r["name"], {}).get("mean_recall"))] if compare else []
            lines.append(_md_row([r["name"], r["split"], str(r.get("images", DASH)), str(r.get("captions", DASH)),
                                  *ours, *theirs, *_row_published(published, r["name"], RETRIEVAL, used)]))
        lines.append("")
    if used:
        lines += ["Published numbers:", ""] + [f"- {model}: {source}" for model, source in used] + [""]
    lines += _phrase_lines(cls)
    if results.get("unrecognised"):
        lines += ["Not recognised (not evaluated): " + ", ".join(f"`{p}`" for p in results["unrecognised"]), ""]
    return "\n".join(lines)


def _phrase_lines(cls: list[dict]) -> list[str]:
    out = []
    for r in cls:
        differ = [f"`{folder}` -> \"{phrase}\"" for folder, phrase in r.get("class_phrases", {}).items()
                  if phrase.lower() != folder.lower()]
        if differ:
            out.append(f"- {r['name']}: " + ", ".join(differ))
    return (["Class phrases that differ from the folder names:", ""] + out + [""]) if out else []


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _md_rule(head: list[str], text_columns: int) -> str:
    return "|" + "|".join("---" if i < text_columns else "---:" for i in range(len(head))) + "|"


def plot_report(results: dict, published: Sequence[PublishedResult], path: Path) -> Path | None:
    """Bars per set: ours (and the compared model) beside the published numbers; top-1 for
    classification, mean recall for retrieval. None (one log line) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("suite: matplotlib is not installed, no %s (pip install 'rsclip-ds[plots]')", path.name)
        return None
    groups = [(p, [r for r in results["sets"] if r["protocol"] == p and "error" not in r])
              for p in (CLASSIFICATION, RETRIEVAL)]
    groups = [(p, rs) for p, rs in groups if rs]
    if not groups:
        return None
    compare = results.get("compare")
    series = ["ours"] + (["compare"] if compare else []) + list(FAMILIES)
    fig, axes = plt.subplots(1, len(groups), figsize=(max(6, 1.6 * sum(len(rs) for _, rs in groups) + 3), 4),
                             squeeze=False)
    width = 0.8 / len(series)
    for ax, (protocol, rs) in zip(axes[0], groups):
        key = HEADLINE[protocol]
        other = _by_name(compare["sets"], protocol) if compare else {}
        for j, name in enumerate(series):
            values = []
            for r in rs:
                if name == "ours":
                    values.append(100 * r[key])
                elif name == "compare":   # not published / not scored: no bar (NaN), not a 0
                    values.append(100 * other[r["name"]][key] if key in other.get(r["name"], {}) else float("nan"))
                else:
                    p = published_value(published, name, r["name"], protocol)
                    values.append(percent(p) if p is not None else float("nan"))
            label = (f"compare: {short_model(compare['model'])}" if name == "compare" else
                     f"ours: {short_model(results['model'])}" if name == "ours" else f"{name} (published)")
            ax.bar([i + (j - (len(series) - 1) / 2) * width for i in range(len(rs))], values, width, label=label)
        ax.set_xticks(range(len(rs)), [r["name"] for r in rs], rotation=30, ha="right")
        ax.set_ylabel("top-1 (%)" if key == "top1" else "mean recall (%)")
        ax.set_title(protocol)
        ax.set_ylim(0, 100)
        ax.set_xlim(-0.5, len(rs) - 0.5)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(results: dict, out_dir: Path, published: Sequence[PublishedResult]) -> list[Path]:
    """samples/<set>.<kind>.jsonl (the records' per-sample rows, which leave the records for the file's name:
    samples.py), suite.json (everything, fractions), suite.md (the tables), suite.png (without matplotlib:
    not) and report.html (html_report.py: what the model got wrong, from those files)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = write_samples(sample_files(results), out_dir)
    written = [out_dir / "suite.json", out_dir / "suite.md"]
    names = {r["name"] for r in results["sets"]}
    record = {**results, "published": [asdict(p) for p in published if p.set in names]}
    written[0].write_text(json.dumps(record, indent=2, default=str, ensure_ascii=False), encoding="utf-8")
    written[1].write_text(markdown_report(results, published), encoding="utf-8")
    png = plot_report(results, published, out_dir / "suite.png")
    return rows + written + ([png] if png else []) + [write_html_report(out_dir)]
