"""report.html: where and why the model is wrong, on one page that opens from disk.

    write_html_report(out_dir)   -> out_dir/report.html

Read from out_dir/suite.json, the per-sample files it names (samples/<set>.zero-shot.jsonl,
samples/<set>.retrieval.jsonl: docs/reference/file-formats.md) and the image files those name; no
model, no second forward pass. The page, top to bottom:

- the header (model, source, step, template set) and the headline tables with the published
  columns, as suite.md has them;
- with "compare": ours against the compared model, per set;
- per classification set: the confusion matrix (rows: true class, columns: predicted top-1,
  shaded by count / row total, classes ordered by confusion_order), per-class accuracy worst
  first, the most confused pairs with example images and the model's top-3, with "compare" the
  classes that gained and lost most, and the images that could not be read;
- per retrieval set: R@1/5/10 both ways, a seeded sample of caption queries and the worst-ranked
  ones with their top-5 images (the right one marked), the worst-ranked image queries, the
  images that could not be read;
- a set that was not scored ("error") is shown as failed.

One self-contained file: each distinct image is encoded once as a small JPEG data URI into one
JSON map (id -> URI) in the page, and a script at the end of the body fills every
<img data-thumb=id>; an image that cannot be opened now gets an inline SVG placeholder. No network,
no external CSS or JS. Gallery caps the galleries: a 10,000-image, 45-class set stays about 1 MB.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence
from urllib.parse import quote

import numpy as np
from PIL import Image

from rsclip_ds.evaluation.catalog import PublishedResult
from rsclip_ds.evaluation.published import DASH, FAMILIES, pct, percent, published_value, short_model
from rsclip_ds.evaluation.samples import read_rows
from rsclip_ds.evaluation.suite import CLASSIFICATION, RETRIEVAL, RETRIEVAL_KEYS

log = logging.getLogger("rsclip_ds")
MISSING = "missing"        # the thumbnail id of every image that cannot be opened now
LIST_CAP = 100             # unreadable images listed per set (the samples file has them all)
ORDER_RULE = ("Classes are ordered so that confused classes sit together: greedy chaining on the "
              "symmetrised off-diagonal counts (true → predicted plus predicted → true). A chain starts "
              "at the most confused pair of classes not yet placed and grows, at either end, by the "
              "class most confused with that end; it stops when no class left is confused with either "
              "end, and the next chain starts. Ties go to the class whose phrase sorts first. Classes "
              "never confused come last, by phrase.")


@dataclass(frozen=True)
class Gallery:
    """How much of the per-sample results the page shows (what keeps it a few MB)."""
    thumb_px: int = 96      # longest side of an embedded thumbnail
    quality: int = 70       # its JPEG quality
    max_pairs: int = 10     # most confused pairs per classification set
    per_pair: int = 4       # example images per pair: the model's most confident mistakes
    max_queries: int = 8    # queries per gallery (the seeded sample; the worst ranked)
    seed: int = 0           # the seeded sample of caption queries


def write_html_report(out_dir: Path, gallery: Gallery = Gallery()) -> Path:
    """out_dir/suite.json + the samples files it names -> out_dir/report.html (returned)."""
    out_dir = Path(out_dir)
    suite = json.loads((out_dir / "suite.json").read_text(encoding="utf-8"))
    thumbs = Thumbnails(gallery.thumb_px, gallery.quality)
    compare = suite.get("compare")
    theirs = {(r["name"], r["protocol"]): r for r in compare["sets"]} if compare else {}
    body = _header(suite) + _comparison(suite)
    for i, record in enumerate(suite["sets"]):
        compared = theirs.get((record["name"], record["protocol"]))
        if compared is not None:   # the set's record under the compared model, named for the tables
            compared = {**compared, "model": compare["model"]}
        body += _set_section(out_dir, i, record, compared, thumbs, gallery)
    page = _page(f"Evaluation report: {suite.get('model', '?')}", body, thumbs)
    path = out_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    log.info("report: %s (%.0f KB, %d thumbnails)", path, len(page.encode()) / 1024, len(thumbs.uris))
    return path


# --------------------------------------------------------------------------- the numbers

def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """(C, C) int64: [i, j] = images of true class i predicted (top-1) as class j."""
    flat = labels.astype(np.int64) * num_classes + predicted.astype(np.int64)   # (N,)
    return np.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def confusion_order(matrix: np.ndarray, names: Sequence[str]) -> list[int]:
    """The class indices in display order: confused classes side by side (ORDER_RULE says it in
    words). Greedy chaining on S = M + M^T with a zero diagonal: start a chain at the heaviest pair
    of unplaced classes, grow it at whichever end has the heaviest link to an unplaced class,
    close it when neither end has one; ties by phrase (then by index), the tail before the head.
    Classes with no confusion at all come last, by phrase. Deterministic; O(C^2) per chain."""
    n = len(names)
    s = (matrix + matrix.T).astype(np.int64)
    np.fill_diagonal(s, 0)
    by_name = sorted(range(n), key=lambda i: (names[i], i))
    rank = np.empty(n, dtype=np.int64)
    rank[by_name] = np.arange(n)          # rank[i]: class i's place in phrase order (the tie-break)
    placed = np.zeros(n, dtype=bool)
    order: list[int] = []
    while True:
        free = ~placed
        links = np.where(np.outer(free, free), s, 0)
        if links.max(initial=0) <= 0:
            break
        top = np.argwhere(links == links.max())
        i, j = min(((int(a), int(b)) for a, b in top if rank[a] < rank[b]), key=lambda p: (rank[p[0]], rank[p[1]]))
        chain = [i, j]
        placed[[i, j]] = True
        while True:
            best = None
            for at_tail, end in ((True, chain[-1]), (False, chain[0])):
                w = np.where(placed, -1, s[end])
                if w.max() <= 0:
                    continue
                k = int(min(np.flatnonzero(w == w.max()), key=lambda c: rank[c]))
                key = (-int(w[k]), int(rank[k]), not at_tail)
                if best is None or key < best[0]:
                    best = (key, k, at_tail)
            if best is None:
                break
            _, k, at_tail = best
            chain = chain + [k] if at_tail else [k] + chain
            placed[k] = True
        order += chain
    return order + [i for i in by_name if not placed[i]]


# --------------------------------------------------------------------------- thumbnails

_PLACEHOLDER = "data:image/svg+xml;charset=utf-8," + quote(
    '<svg xmlns="http://www.w3.org/2000/svg" width="96" height="96" viewBox="0 0 96 96">'
    '<rect x="1" y="1" width="94" height="94" fill="#f3f3f3" stroke="#b00" stroke-width="2"/>'
    '<path d="M28 22L68 62M68 22L28 62" stroke="#b00" stroke-width="5"/>'
    '<text x="48" y="84" font-family="sans-serif" font-size="11" text-anchor="middle" fill="#900">'
    'not readable</text></svg>')


class Thumbnails:
    """Each distinct image path encoded once (id -> JPEG data URI); the page holds the map."""

    def __init__(self, px: int, quality: int):
        self.px, self.quality = px, quality
        self.ids: dict[str, str] = {}          # path -> id
        self.uris: dict[str, str] = {}         # id -> data URI (the images that could be read)
        self.failed: dict[str, str] = {}       # path -> why it cannot be opened now

    def ref(self, path: str) -> str:
        if path not in self.ids:
            try:
                uri = self._encode(path)
            except (OSError, ValueError, Image.DecompressionBombError) as err:   # missing, not an image, ...
                self.failed[path] = f"{type(err).__name__}: {err}"
                self.ids[path] = MISSING
            else:
                self.ids[path] = f"t{len(self.uris)}"
                self.uris[self.ids[path]] = uri
        return self.ids[path]

    def _encode(self, path: str) -> str:
        with Image.open(path) as src:
            src.draft("RGB", (self.px, self.px))      # JPEG: decode at 1/2 .. 1/8 scale, much faster
            im = src.convert("RGB")
        im.thumbnail((self.px, self.px))
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=self.quality)
        return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")

    def img(self, path: str) -> str:
        tid = self.ref(path)
        title = path if tid != MISSING else f"{path}: cannot be opened now ({self.failed[path]})"
        return f'<img data-thumb="{tid}" alt="{_e(Path(path).name)}" title="{_e(title)}">'

    def script(self) -> str:
        """The map (JSON, '</' escaped so that it cannot close the script) and the filler."""
        data = json.dumps({**self.uris, MISSING: _PLACEHOLDER}).replace("</", "<\\/")
        return (f'<script type="application/json" id="thumbs">{data}</script>\n<script>\n'
                '(function () {\n'
                '  var uris = JSON.parse(document.getElementById("thumbs").textContent);\n'
                '  document.querySelectorAll("img[data-thumb]").forEach(function (img) {\n'
                '    img.src = uris[img.getAttribute("data-thumb")];\n'
                '  });\n'
                '})();\n</script>')


def _figure(thumbs: Thumbnails, path: str, caption: str, mark: str = "") -> str:
    """A thumbnail with its caption (already HTML); mark: a CSS class ("correct", "query")."""
    return (f'<figure class="thumb {mark}" data-image="{_e(path)}">{thumbs.img(path)}'
            f'<figcaption>{caption}</figcaption></figure>')


# --------------------------------------------------------------------------- the page

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI","Noto Sans","Noto Sans CJK SC",sans-serif;
  margin:1.5em auto;padding:0 1.5em;color:#222;max-width:1500px}
h1{font-size:1.5em;margin-bottom:.2em} h2{margin-top:2em;border-bottom:2px solid #ddd}
h3{margin:1.2em 0 .4em} .meta{color:#555} .note{color:#555;font-size:.9em;max-width:60em}
table{border-collapse:collapse;margin:.4em 0}
th,td{padding:2px 7px;border:1px solid #ddd;text-align:right;vertical-align:top}
th{background:#f5f5f5;font-weight:600} .l{text-align:left}
.failed{color:#b00} .pos{color:#17701a} .neg{color:#b00}
.scroll{overflow-x:auto;max-width:100%}
table.confusion td{min-width:1.7em;height:1.7em;padding:0 2px;text-align:center;font-size:11px}
table.confusion td.dark{color:#fff}
table.confusion th.col{writing-mode:vertical-rl;transform:rotate(180deg);white-space:nowrap;
  font-weight:normal;font-size:11px;text-align:left;padding:4px 1px}
table.confusion th.row{font-weight:normal;font-size:12px;text-align:left;white-space:nowrap}
.bar{display:inline-block;height:.7em;background:#4a7fb5;vertical-align:middle}
.side{display:flex;gap:2.5em;flex-wrap:wrap;align-items:flex-start}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:.2em 2em}
.pair{margin:.5em 0} .gallery{display:flex;flex-wrap:wrap;gap:8px;margin:.3em 0}
figure.thumb{margin:0;width:112px;font-size:10.5px;line-height:1.25;overflow-wrap:anywhere}
figure.thumb img{width:96px;height:96px;object-fit:contain;background:#eee;display:block;
  border:4px solid transparent}
figure.correct img{border-color:#2ca02c} figure.query img{border-color:#888}
figure.correct figcaption{color:#17701a;font-weight:600}
.query-text{margin:.6em 0 .1em;font-weight:600}
.image-query{display:flex;gap:1.2em;margin:.6em 0;font-size:12px}
.image-query ol,.image-query ul{margin:.2em 0;padding-left:1.4em} .query-text .rank{font-weight:normal;color:#555}
"""


def _page(title: str, body: list[str], thumbs: Thumbnails) -> str:
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
        '<noscript><p class="failed">The thumbnails are filled in by the script at the end of this page: '
        "allow JavaScript for this file to see them.</p></noscript>",
        *body, thumbs.script(), "</body>", "</html>", ""])


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _delta(points: float | None) -> str:
    """A difference in percentage points, coloured by its sign."""
    if points is None:
        return f"<td>{DASH}</td>"
    cls = "pos" if points > 0 else "neg" if points < 0 else ""
    return f'<td class="{cls}">{points:+.2f}</td>'


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 1, cls: str = "") -> str:
    """head: plain text (escaped here); rows: cells already HTML (a cell starting with <td is kept)."""
    out = [f'<table class="{cls}">' if cls else "<table>", "<tr>" + "".join(
        f'<th class="l">{_e(h)}</th>' if i < text_columns else f"<th>{_e(h)}</th>" for i, h in enumerate(head)) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(c if c.startswith("<td") else (f'<td class="l">{c}</td>' if i < text_columns
                                                                    else f"<td>{c}</td>")
                                    for i, c in enumerate(row)) + "</tr>")
    return "\n".join(out + ["</table>"])


def _published(suite: dict) -> list[PublishedResult]:
    known = {f.name for f in fields(PublishedResult)}
    return [PublishedResult(**{k: v for k, v in p.items() if k in known}) for p in suite.get("published", [])]


def _header(suite: dict) -> list[str]:
    """The title, what was evaluated, and the two headline tables with the published columns."""
    published = _published(suite)
    meta = [f"model <b>{_e(suite.get('model', '?'))}</b>"]
    if suite.get("source") and suite.get("source") != suite.get("model"):
        meta.append(f"source {_e(suite['source'])}")
    if suite.get("step") is not None:
        meta.append(f"step {_e(suite['step'])}")
    ts = f"template set <code>{_e(suite.get('template_set', '?'))}</code>"
    meta.append(ts + (f" ({_e(suite['template_source'])})" if suite.get("template_source") else ""))
    out = [f"<h1>Evaluation report: {_e(short_model(suite.get('model', '?')))}</h1>",
           f'<p class="meta">{" · ".join(meta)}</p>',
           f'<p class="note">Percent. Published numbers beside ours where the model\'s paper or card has the set '
           f'({DASH}: not published). Generated from suite.json and the per-sample files beside it.</p>']
    compare = suite.get("compare")
    other = {(r["name"], r["protocol"]): r for r in compare["sets"]} if compare else {}
    used: dict = {}
    for protocol, keys, names in (
            (CLASSIFICATION, ("top1", "top5", "mean_per_class"), ["top-1", "top-5", "mean per class"]),
            (RETRIEVAL, RETRIEVAL_KEYS, ["i2t R@1", "i2t R@5", "i2t R@10", "t2i R@1", "t2i R@5", "t2i R@10",
                                         "mean recall"])):
        records = [(i, r) for i, r in enumerate(suite["sets"]) if r["protocol"] == protocol]
        if not records:
            continue
        headline = keys[0] if protocol == CLASSIFICATION else "mean_recall"
        extra = [f"{short_model(compare['model'])} {names[keys.index(headline)]}"] if compare else []
        counts = ("images", "classes") if protocol == CLASSIFICATION else ("images", "captions")
        rows = []
        for i, r in records:
            name = f'<a href="#set-{i}">{_e(r["name"])}</a>'
            ours = ([f'<td class="failed l" colspan="{len(keys)}">failed: {_e(r["error"])}</td>'] if "error" in r
                    else [pct(r.get(k)) for k in keys])
            theirs = [pct(other.get((r["name"], protocol), {}).get(headline))] if compare else []
            cells = []
            for family in FAMILIES:
                p = published_value(published, family, r["name"], protocol)
                if p is not None:
                    used[(p.model, p.source)] = None
                cells.append(DASH if p is None else f"{percent(p):.2f}")
            rows.append([name, _e(r.get("split", "")), *[_e(r.get(c, DASH)) for c in counts], *ours, *theirs, *cells])
        out += [f"<h2>{'Zero-shot classification' if protocol == CLASSIFICATION else 'Retrieval'}</h2>",
                _table(["set", "split", *counts, *names, *extra, *FAMILIES], rows, text_columns=2)]
    if used:
        out.append('<p class="note">Published numbers: ' + "; ".join(
            f"{_e(model)}: {_link(source)}" for model, source in used) + "</p>")
    if suite.get("unrecognised"):
        out.append('<p class="note">Not recognised (not evaluated): '
                   + ", ".join(f"<code>{_e(p)}</code>" for p in suite["unrecognised"]) + "</p>")
    return out


def _link(text: str) -> str:
    url = str(text).split()[0] if str(text).strip() else ""
    if url.startswith(("https://", "http://")):
        return f'<a href="{_e(url)}">{_e(text)}</a>'
    return _e(text)


def _comparison(suite: dict) -> list[str]:
    """Ours against the compared model, per set and metric (percentage points)."""
    compare = suite.get("compare")
    if not compare:
        return []
    other = {(r["name"], r["protocol"]): r for r in compare["sets"]}
    metrics = {CLASSIFICATION: [("top1", "top-1"), ("top5", "top-5"), ("mean_per_class", "mean per class")],
               RETRIEVAL: [("mean_recall", "mean recall"), ("t2i_R@1", "t2i R@1"), ("i2t_R@1", "i2t R@1")]}
    rows = []
    for r in suite["sets"]:
        o = other.get((r["name"], r["protocol"]), {})
        for key, label in metrics[r["protocol"]]:
            ours, theirs = r.get(key), o.get(key)
            if ours is None and theirs is None:   # failed under both: the headline table says why
                continue
            delta = 100 * (ours - theirs) if ours is not None and theirs is not None else None
            rows.append([_e(r["name"]), _e(r["protocol"]), _e(label), pct(ours), pct(theirs), _delta(delta)])
    return [f"<h2>Compared with {_e(short_model(compare['model']))}</h2>",
            f'<p class="meta">{_e(compare["model"])}'
            + (f" · template set <code>{_e(compare['template_set'])}</code>" if compare.get("template_set") else "")
            + "</p>",
            _table(["set", "protocol", "metric", f"ours ({short_model(suite.get('model', '?'))})",
                    short_model(compare["model"]), "Δ (points)"], rows, text_columns=3)]


def _set_section(out_dir: Path, i: int, record: dict, compared: dict | None, thumbs: Thumbnails,
                 gallery: Gallery) -> list[str]:
    title = f'<h2 id="set-{i}">{_e(record["name"])} · {_e(record["protocol"])} ({_e(record.get("split", ""))})</h2>'
    out = [title] + [f'<p class="note">warning: {_e(w)}</p>' for w in record.get("warnings", [])]
    if "error" in record:
        return out + [f'<p class="failed">failed, not scored: {_e(record["error"])}</p>']
    samples = out_dir / record["samples"] if record.get("samples") else None
    if samples is None or not samples.is_file():
        log.warning("report: %s (%s): no per-sample file %s", record["name"], record["protocol"], samples)
        return out + [f'<p class="failed">no per-sample file ({_e(samples or "none named in suite.json")}): '
                      "the galleries and the confusion matrix are left out</p>"]
    rows = read_rows(samples)
    if record["protocol"] == CLASSIFICATION:
        return out + _classification(record, rows, compared, thumbs, gallery)
    return out + _retrieval(record, rows, thumbs, gallery)


# --------------------------------------------------------------------------- classification

def _classification(record: dict, rows: list[dict], compared: dict | None, thumbs: Thumbnails,
                    gallery: Gallery) -> list[str]:
    phrases = list(record["class_phrases"].values())        # class index i is the i-th entry
    ok = [r for r in rows if r["readable"]]
    labels = np.array([r["label"] for r in ok], dtype=np.int64)          # (N_ok,)
    predicted = np.array([r["top5"][0] for r in ok], dtype=np.int64)     # (N_ok,)
    matrix = confusion_matrix(labels, predicted, len(phrases))            # (C, C)
    order = confusion_order(matrix, phrases)
    out = [f'<p class="meta">{_e(record.get("images", len(ok)))} images scored, {len(phrases)} classes, '
           f'{len(record.get("templates", []))} templates · top-1 {pct(record.get("top1"))} · '
           f'top-5 {pct(record.get("top5"))} · mean per class {pct(record.get("mean_per_class"))}</p>',
           "<h3>Confusion matrix</h3>",
           '<p class="note">Rows: the true class; columns: the predicted (top-1) class; shade: the share of '
           f"the row's images (green on the diagonal, red off it). {ORDER_RULE}</p>",
           _confusion_table(matrix, order, phrases),
           "<h3>Per-class accuracy, worst first</h3>",
           _accuracy_table(matrix, phrases, compared)]
    if compared and compared.get("per_class"):
        out += _gained_lost(record.get("per_class", {}), compared["per_class"], short_model(compared.get("model", "")))
    out += _confused_pairs(matrix, phrases, ok, labels, predicted, thumbs, gallery)
    bad = [r for r in rows if not r["readable"]]
    return out + _unreadable([(r["image"], r.get("label_name", ""), r.get("error")) for r in bad], "class")


def _confusion_table(matrix: np.ndarray, order: list[int], phrases: list[str]) -> str:
    totals = matrix.sum(axis=1)
    out = ['<div class="scroll"><table class="confusion">',
           '<tr><th class="l">true \\ predicted</th>'
           + "".join(f'<th class="col" data-class="{_e(phrases[j])}">{_e(phrases[j])}</th>' for j in order)
           + "<th>images</th></tr>"]
    for i in order:
        cells = []
        for j in order:
            n, total = int(matrix[i, j]), int(totals[i])
            attrs = f'data-true="{_e(phrases[i])}" data-pred="{_e(phrases[j])}" data-count="{n}"'
            if n == 0:
                cells.append(f"<td {attrs}></td>")
                continue
            share = n / total
            colour = "44,160,44" if i == j else "214,39,40"
            cells.append(f'<td {attrs} class="{"dark" if share > 0.55 else ""}" '
                         f'style="background:rgba({colour},{0.08 + 0.92 * share:.2f})" '
                         f'title="{_e(phrases[i])} → {_e(phrases[j])}: {n} of {total}">{n}</td>')
        out.append(f'<tr><th class="row" data-class="{_e(phrases[i])}">{_e(phrases[i])}</th>{"".join(cells)}'
                   f"<td>{int(totals[i])}</td></tr>")
    return "\n".join(out + ["</table></div>"])


def _accuracy_table(matrix: np.ndarray, phrases: list[str], compared: dict | None) -> str:
    """One row per class: images, correct, top-1 (a bar), the class it is most often taken for."""
    totals, correct = matrix.sum(axis=1), np.diag(matrix)
    off = matrix.copy()
    np.fill_diagonal(off, 0)
    theirs = (compared or {}).get("per_class") or {}
    worst_first = sorted(range(len(phrases)), key=lambda i: (totals[i] == 0, correct[i] / max(totals[i], 1), phrases[i]))
    rows = []
    for i in worst_first:
        acc = correct[i] / totals[i] if totals[i] else None
        bar = f'<span class="bar" style="width:{60 * acc:.0f}px"></span> ' if acc is not None else ""
        taken = f"{_e(phrases[int(off[i].argmax())])} ({int(off[i].max())})" if off[i].max() > 0 else ""
        row = [_e(phrases[i]), str(int(totals[i])), str(int(correct[i])),
               f'<td data-class="{_e(phrases[i])}" class="accuracy">{bar}{pct(acc)}</td>', f'<td class="l">{taken}</td>']
        if compared:
            other = theirs.get(phrases[i])
            row += [pct(other), _delta(100 * (acc - other) if acc is not None and other is not None else None)]
        rows.append(row)
    head = ["class", "images", "correct", "top-1", "most often taken for"]
    head += [f"{short_model(compared.get('model', 'compared'))} top-1", "Δ (points)"] if compared else []
    return _table(head, rows)


def _gained_lost(ours: dict, theirs: dict, other: str, k: int = 8) -> list[str]:
    """The classes whose top-1 rose and fell most against the compared model, side by side."""
    deltas = sorted(((100 * (ours[c] - theirs[c]), c) for c in ours if c in theirs), key=lambda d: (-d[0], d[1]))
    gained = [d for d in deltas if d[0] > 0][:k]
    lost = sorted((d for d in deltas if d[0] < 0), key=lambda d: (d[0], d[1]))[:k]

    def side(title: str, items, cls: str) -> str:
        rows = [[_e(c), pct(ours[c]), pct(theirs[c]), _delta(d)] for d, c in items]
        return (f'<div class="{cls}"><h3>{_e(title)}</h3>'
                + (_table(["class", "ours", other or "compared", "Δ (points)"], rows) if rows else "<p>none</p>")
                + "</div>")
    return ['<div class="side">', side(f"Gained most against {other}", gained, "gained"),
            side(f"Lost most against {other}", lost, "lost"), "</div>"]


def _confused_pairs(matrix: np.ndarray, phrases: list[str], ok: list[dict], labels: np.ndarray,
                    predicted: np.ndarray, thumbs: Thumbnails, gallery: Gallery) -> list[str]:
    """The most confused (true, predicted) pairs by count (ties by phrases), each with its most
    confident mistakes and the model's top-3 for them."""
    off = matrix.copy()
    np.fill_diagonal(off, 0)
    pairs = sorted(((int(off[i, j]), int(i), int(j)) for i, j in np.argwhere(off > 0)),
                   key=lambda p: (-p[0], phrases[p[1]], phrases[p[2]]))[:gallery.max_pairs]
    if not pairs:
        return ["<h3>Most confused pairs</h3>", "<p>No image was misclassified.</p>"]
    out = ["<h3>Most confused pairs</h3>",
           f'<p class="note">True → predicted, with the count; the examples are the {gallery.per_pair} '
           "mistakes the model was surest of, with its top-3 classes and cosine scores (the true class in "
           'bold).</p>', '<div class="grid pairs">']
    for n, i, j in pairs:
        mine = np.flatnonzero((labels == i) & (predicted == j))                  # in set order
        surest = sorted(mine, key=lambda k: -ok[k]["top5_scores"][0])[:gallery.per_pair]
        figures = []
        for k in surest:
            r = ok[k]
            said = "<br>".join(f"{'<b>' if c == i else ''}{_e(name)} {s:.3f}{'</b>' if c == i else ''}"
                               for c, name, s in list(zip(r["top5"], r["top5_names"], r["top5_scores"]))[:3])
            figures.append(_figure(thumbs, r["image"], said))
        out.append(f'<div class="pair" data-true="{_e(phrases[i])}" data-pred="{_e(phrases[j])}" data-count="{n}">'
                   f"<b>{_e(phrases[i])}</b> → <b>{_e(phrases[j])}</b>: {n}"
                   f'<div class="gallery">{"".join(figures)}</div></div>')
    return out + ["</div>"]


def _unreadable(items: list[tuple[str, str, str | None]], what: str) -> list[str]:
    """The images that could not be read at evaluation time, with why (capped; the file has all)."""
    if not items:
        return []
    body = [[_e(path), _e(extra), _e(err or "unknown")] for path, extra, err in items[:LIST_CAP]]
    more = (f"<p class=\"note\">and {len(items) - LIST_CAP} more (all in the samples file)</p>"
            if len(items) > LIST_CAP else "")
    return [f'<h3 class="unreadable">Unreadable images ({len(items)})</h3>',
            '<p class="note">Skipped at evaluation time and left out of the numbers.</p>',
            _table(["image", what, "error"], body, text_columns=3, cls="unreadable"), more]


# --------------------------------------------------------------------------- retrieval

def _retrieval(record: dict, rows: list[dict], thumbs: Thumbnails, gallery: Gallery) -> list[str]:
    captions = [r for r in rows if r["query"] == "caption"]
    images = [r for r in rows if r["query"] == "image"]
    ok_c = [r for r in captions if r["readable"]]
    ok_i = [r for r in images if r["readable"]]
    text = {r["caption_index"]: r["caption"] for r in captions}

    def median(rs: list[dict]) -> str:
        return f"{np.median([r['rank'] for r in rs]):g}" if rs else DASH
    recall = [["caption → image (t2i)", *[pct(record.get(f"t2i_R@{k}")) for k in (1, 5, 10)], median(ok_c)],
              ["image → caption (i2t)", *[pct(record.get(f"i2t_R@{k}")) for k in (1, 5, 10)], median(ok_i)]]
    out = [f'<p class="meta">{_e(record.get("images", len(ok_i)))} images, {_e(record.get("captions", len(ok_c)))} '
           f'captions scored · mean recall {pct(record.get("mean_recall"))}</p>',
           _table(["direction", "R@1", "R@5", "R@10", "median rank"], recall, cls="recall")]
    k = min(gallery.max_queries, len(ok_c))
    sample = [ok_c[n] for n in sorted(random.Random(gallery.seed).sample(range(len(ok_c)), k))]
    worst = sorted(ok_c, key=lambda r: (-r["rank"], r["caption_index"]))[:gallery.max_queries]
    out += [f"<h3>Caption queries: a fixed sample of {k}</h3>",
            f'<p class="note">Seed {gallery.seed}. The top-5 images of each; green: its own image.</p>',
            '<div class="grid">', *[_caption_query(r, thumbs) for r in sample], "</div>",
            f"<h3>Caption queries ranked worst ({len(worst)})</h3>",
            '<p class="note">Largest rank of the right image first; its own image follows the top-5.</p>',
            '<div class="grid">', *[_caption_query(r, thumbs, own=True, cls="worst") for r in worst], "</div>"]
    worst_i = sorted(ok_i, key=lambda r: (-r["rank"], r["image_index"]))[:gallery.max_queries]
    out += [f"<h3>Image queries ranked worst ({len(worst_i)})</h3>",
            '<p class="note">The query image, the captions the model put first, and its own captions.</p>',
            '<div class="grid">', *[_image_query(r, text, thumbs) for r in worst_i], "</div>"]
    # one line per unreadable image: its image-query row has the error, its caption rows say how many were left out
    left_out: dict[str, int] = {}
    for r in captions:
        if not r["readable"]:
            left_out[r["image"]] = left_out.get(r["image"], 0) + 1
    errors = {r["image"]: r.get("error") for r in images if not r["readable"]}
    items = [(path, str(left_out.get(path, 0)), errors.get(path)) for path in {**errors, **left_out}]
    return out + _unreadable(items, "captions left out")


def _caption_query(r: dict, thumbs: Thumbnails, own: bool = False, cls: str = "sample") -> str:
    figures = [_figure(thumbs, path, f"{n + 1}. {s:.3f}" + (" ✓" if idx == r["image_index"] else ""),
                       "correct" if idx == r["image_index"] else "")
               for n, (idx, path, s) in enumerate(zip(r["top5"], r["top5_images"], r["top5_scores"]))]
    if own and r["image_index"] not in r["top5"]:
        figures.append(_figure(thumbs, r["image"], f"its image, rank {r['rank']}", "correct"))
    return (f'<div class="query {cls}" data-caption-index="{r["caption_index"]}" data-rank="{r["rank"]}">'
            f'<p class="query-text">“{_e(r["caption"])}” <span class="rank">rank {r["rank"]}</span></p>'
            f'<div class="gallery">{"".join(figures)}</div></div>')


def _image_query(r: dict, text: dict, thumbs: Thumbnails) -> str:
    mine = set(r.get("captions", []))
    said = "".join(f'<li class="{"pos" if c in mine else ""}">{s:.3f} {_e(t)}</li>'
                   for c, t, s in list(zip(r["top5"], r["top5_captions"], r["top5_scores"]))[:3])
    own = "".join(f"<li>{_e(text.get(c, c))}</li>" for c in r.get("captions", []))
    query = _figure(thumbs, r["image"], f"rank {r['rank']}", "query")
    return (f'<div class="query image-query" data-image-index="{r["image_index"]}" data-rank="{r["rank"]}">'
            f"{query}"
            f"<div><b>put first</b><ol>{said}</ol></div><div><b>its captions</b><ul>{own}</ul></div></div>")
