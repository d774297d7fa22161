"""report.html from a hand-written suite folder (tests/unit/html_report_fixture.py): the confusion
matrix's cells and order, per-class accuracy, the galleries, the comparison, bad input, the caps.
The page is parsed with html.parser into a small tree and read the way a person reads it."""

from __future__ import annotations

import base64
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rsclip_ds.evaluation.html_report import (MISSING, Gallery, confusion_matrix, confusion_order,
                                              write_html_report)
from tests.unit import html_report_fixture as fx


# --------------------------------------------------------------------------- a small tree of the page

class Node:
    def __init__(self, tag: str, attrs: dict):
        self.tag, self.attrs, self.children = tag, attrs, []

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def find_all(self, tag: str | None = None, cls: str | None = None, **attrs) -> list["Node"]:
        out = []
        for c in self.children:
            if isinstance(c, Node):
                if ((tag is None or c.tag == tag) and (cls is None or cls in c.classes())
                        and all(c.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())):
                    out.append(c)
                out += c.find_all(tag, cls, **attrs)
        return out

    def find(self, *args, **kwargs) -> "Node":
        found = self.find_all(*args, **kwargs)
        assert found, f"no {args} {kwargs}"
        return found[0]


class TreeBuilder(HTMLParser):
    VOID = {"img", "meta", "br", "link", "input", "hr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs))
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):   # close up to the matching open tag
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def parse(page: str) -> Node:
    builder = TreeBuilder()
    builder.feed(page)
    return builder.root


def section(root: Node, name: str) -> Node:
    """The nodes between the <h2> of set `name` and the next <h2>, as one node."""
    body = root.find("body")
    out, inside = Node("#section", {}), False
    for c in body.children:
        if isinstance(c, Node) and c.tag == "h2":
            inside = c.text().startswith(name + " ·")
            continue
        if inside:
            out.children.append(c)
    assert out.children, f"no section {name}"
    return out


def thumbnail_map(page: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="thumbs">(.*?)</script>', page, re.S).group(1))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    facts = fx.make_suite(tmp_path_factory.mktemp("html_report") / "suite")
    path = write_html_report(facts["dir"])
    page = path.read_text(encoding="utf-8")
    return {**facts, "path": path, "page": page, "root": parse(page)}


# --------------------------------------------------------------------------- classification

def test_confusion_cells_hold_the_known_confusions(report):
    ucm = section(report["root"], "UCM")
    cells = [n for n in ucm.find_all("td") if "data-true" in n.attrs]
    assert len(cells) == 7 * 7
    for cell in cells:
        true, pred = cell.attrs["data-true"], cell.attrs["data-pred"]
        want = fx.DIAGONAL[true] if true == pred else fx.CONFUSIONS.get((true, pred), 0)
        assert int(cell.attrs["data-count"]) == want, (true, pred)
        assert cell.text() == (str(want) if want else ""), (true, pred)
    # row totals: the images of each class that were read (the empty class: a row of zeros)
    rows = {r.find("th").text(): r.find_all("td")[-1].text() for r in ucm.find("table", cls="confusion").find_all("tr")[1:]}
    assert rows == {"dense residential": "5", "medium residential": "4", "farmland": "3", "meadow": "4", "airport": "2",
                    "empty class": "0", "港口": "2"}


def test_confused_classes_sit_together(report):
    table = section(report["root"], "UCM").find("table", cls="confusion")
    columns = [th.attrs["data-class"] for th in table.find_all("th", cls="col")]
    rows = [th.attrs["data-class"] for th in table.find_all("th", cls="row")]
    assert columns == rows == fx.ORDER
    assert "greedy chaining" in section(report["root"], "UCM").text()   # the rule is on the page


def test_per_class_accuracy_worst_first(report):
    cells = section(report["root"], "UCM").find_all("td", cls="accuracy")
    assert [c.attrs["data-class"] for c in cells] == fx.WORST_FIRST
    assert {c.attrs["data-class"]: c.text().strip() for c in cells} == fx.ACCURACY


def test_most_confused_pairs_show_the_mistakes_and_what_the_model_said(report):
    pairs = section(report["root"], "UCM").find_all("div", cls="pair")
    assert [(p.attrs["data-true"], p.attrs["data-pred"], p.attrs["data-count"]) for p in pairs] == [
        ("dense residential", "medium residential", "2"), ("meadow", "farmland", "1"),
        ("medium residential", "dense residential", "1")]
    first = pairs[0].find_all("figure")
    assert len(first) == 2
    # the surest mistake first: the image deleted after the evaluation, shown as the placeholder
    assert first[0].attrs["data-image"] == report["missing_image"]
    assert first[0].find("img").attrs["data-thumb"] == MISSING
    assert "cannot be opened now" in first[0].find("img").attrs["title"]
    assert first[0].find("figcaption").text() == "medium residential 0.450dense residential 0.367meadow 0.337"
    assert first[1].find("img").attrs["data-thumb"] != MISSING


def test_unreadable_and_failed_sets_are_listed(report):
    ucm = section(report["root"], "UCM").find("table", cls="unreadable")
    assert [[td.text() for td in tr.find_all("td")] for tr in ucm.find_all("tr")[1:]] == [
        [str(report["dir"].parent / "images" / "UCM" / "airport_18.png"), "airport",
         "UnidentifiedImageError: cannot identify image file"]]
    rsicd = section(report["root"], "RSICD").find("table", cls="unreadable")
    assert [[td.text() for td in tr.find_all("td")] for tr in rsicd.find_all("tr")[1:]] == [
        [str(report["dir"].parent / "images" / "RSICD" / "scene_4.jpg.png"), "2", "OSError: image file is truncated"]]
    aid = section(report["root"], "AID")
    assert aid.find("p", cls="failed").text().startswith("failed, not scored: 21 of 40 images unreadable")
    assert not aid.find_all("table")


# --------------------------------------------------------------------------- retrieval

def test_worst_caption_queries_come_first_with_their_own_image(report):
    worst = section(report["root"], "RSICD").find_all("div", cls="worst")
    ranks = [int(q.attrs["data-rank"]) for q in worst]
    assert int(worst[0].attrs["data-caption-index"]) == fx.WORST_CAPTION
    assert ranks == sorted(fx.CAPTION_RANKS, reverse=True)
    for q in worst:   # exactly one image marked right: the query's own image
        c = int(q.attrs["data-caption-index"])
        marked = [f.attrs["data-image"] for f in q.find_all("figure", cls="correct")]
        assert marked == [str(report["dir"].parent / "images" / "RSICD" / f"scene_{c // 2}.jpg.png")]
        assert len(q.find_all("figure")) == 4          # 4 readable images: the top-5 holds 4


def test_caption_sample_is_seeded_and_capped(tmp_path):
    facts = fx.make_suite(tmp_path / "suite")

    def sample(seed: int) -> list[int]:
        root = parse(write_html_report(facts["dir"], Gallery(max_queries=3, seed=seed)).read_text(encoding="utf-8"))
        return [int(q.attrs["data-caption-index"]) for q in section(root, "RSICD").find_all("div", cls="sample")]
    first = sample(0)
    assert len(first) == 3 and first == sorted(first) and first == sample(0)
    assert {c for s in range(6) for c in sample(s)} - set(range(8)) == set()   # only readable captions
    assert len({tuple(sample(s)) for s in range(6)}) > 1


def test_single_image_caption_set_renders(report):
    one = section(report["root"], "one-image")
    assert [int(q.attrs["data-rank"]) for q in one.find_all("div", cls="query")] == [1, 1, 1]
    assert one.find("table", cls="recall").find_all("tr")[1].text().startswith("caption → image (t2i)100.00")


# --------------------------------------------------------------------------- header, compare, text

def test_headline_has_the_published_columns(report):
    tables = report["root"].find("body").find_all("table")
    head = [th.text() for th in tables[0].find("tr").find_all("th")]
    assert head[-4:] == ["Git-RSCLIP", "RemoteCLIP", "GeoRSCLIP", "SkyCLIP"]
    ucm = [td.text() for td in tables[0].find_all("tr")[1].find_all("td")]
    assert ucm[0] == "UCM" and ucm[4] == "76.19" and ucm[-4:] == ["—", "70.00", "—", "—"]
    assert ucm[7] == "50.00"   # the compared model's top-1
    rsicd = [td.text() for td in tables[1].find_all("tr")[1].find_all("td")]
    assert rsicd[0] == "RSICD" and rsicd[-4:] == ["35.50", "—", "—", "—"]
    meta = report["root"].find("p", cls="meta").text()
    assert "step 200" in meta and "git-rsclip" in meta


def test_compare_gained_and_lost_side_by_side(report):
    ucm = section(report["root"], "UCM")
    gained = [[td.text() for td in tr.find_all("td")] for tr in ucm.find("div", cls="gained").find_all("tr")[1:]]
    lost = [[td.text() for td in tr.find_all("td")] for tr in ucm.find("div", cls="lost").find_all("tr")[1:]]
    assert [(g[0], g[-1]) for g in gained] == [("港口", "+50.00"), ("dense residential", "+40.00"), ("farmland", "+33.33")]
    assert [(g[0], g[-1]) for g in lost] == [("meadow", "-25.00")]
    per_set = {(tds[0], tds[2]): tds[-1] for tds in ([td.text() for td in tr.find_all("td")]
               for tr in report["root"].find("body").find_all("table")[2].find_all("tr")[1:])}
    assert per_set[("UCM", "top-1")] == "+26.19" and per_set[("RSICD", "mean recall")] == "+53.33"
    assert ("AID", "top-1") not in per_set   # failed under both


def test_non_ascii_and_markup_in_text(report):
    page, raw = report["page"], report["path"].read_bytes()
    assert '<meta charset="utf-8">' in page
    assert "港口".encode() in raw and "许多建筑物和绿树".encode() in raw   # as UTF-8, not entities
    refs = re.findall(r"&#(x[0-9a-fA-F]+|[0-9]+);", page)
    assert all(int(r[1:], 16) < 128 if r.startswith("x") else int(r) < 128 for r in refs)   # only quotes escaped
    assert "planes &amp; &lt;i&gt;jets&lt;/i&gt; at an airport" in page
    assert not report["root"].find_all("i")       # the caption's markup is text, not an element
    assert any("planes & <i>jets</i> at an airport" in q.text() for q in report["root"].find_all("div", cls="query"))


def test_one_self_contained_file(report):
    page = report["page"]
    assert not re.search(r'<(script|img|link)[^>]+(src|href)="(?!data:)', page)   # nothing fetched
    thumbs = thumbnail_map(page)
    assert thumbs[MISSING].startswith("data:image/svg+xml")
    imgs = report["root"].find_all("img")
    assert imgs and all(i.attrs["data-thumb"] in thumbs for i in imgs)
    paths = {f.attrs["data-image"] for f in report["root"].find_all("figure")}
    # each readable image once, plus the placeholder that the one deleted image shares
    assert len(thumbs) == len(paths) and report["missing_image"] in paths
    assert len(report["path"].read_bytes()) < 80_000


def test_missing_samples_file_is_noted(tmp_path):
    facts = fx.make_suite(tmp_path / "suite", compare=False)
    (facts["dir"] / "samples" / "RSICD.retrieval.jsonl").unlink()
    root = parse(write_html_report(facts["dir"]).read_text(encoding="utf-8"))
    assert section(root, "RSICD").find("p", cls="failed").text().startswith("no per-sample file")
    assert section(root, "UCM").find_all("td", cls="accuracy")
    assert "Compared with" not in root.text()


# --------------------------------------------------------------------------- caps and the numbers

def _big_suite(out: Path, classes: int = 6, per_class: int = 40, images: int = 120, seed: int = 0) -> Path:
    """Many mistakes in every pair and many captions: more than any gallery shows."""
    rng = np.random.default_rng(seed)
    (out / "samples").mkdir(parents=True)
    paths = []
    for i in range(classes * per_class + images):
        paths.append(str(out / "img" / f"{i}.png"))
        Path(paths[-1]).parent.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(paths[-1])
    names = [f"class {c}" for c in range(classes)]
    rows = []
    for i in range(classes * per_class):
        label, top = i % classes, list(rng.permutation(classes)[:5])
        rows.append({"image": paths[i], "label": label, "label_name": names[label], "readable": True,
                     "rank": top.index(label) + 1 if label in top else 6, "top5": [int(t) for t in top],
                     "top5_names": [names[t] for t in top], "top5_scores": [0.3, 0.2, 0.1, 0.05, 0.01], "error": None})
    (out / "samples" / "big.zero-shot.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ret, base = [], classes * per_class
    for c in range(2 * images):
        top = [int(t) for t in rng.permutation(images)[:5]]
        ret.append({"query": "caption", "caption_index": c, "caption": f"caption {c}", "image_index": c // 2,
                    "image": paths[base + c // 2], "readable": True, "rank": int(rng.integers(1, images)),
                    "top5": top, "top5_images": [paths[base + t] for t in top], "top5_scores": [0.1] * 5})
    for i in range(images):
        ret.append({"query": "image", "image_index": i, "image": paths[base + i], "readable": True,
                    "rank": int(rng.integers(1, 2 * images)), "top5": [0, 1, 2, 3, 4],
                    "top5_captions": [f"caption {t}" for t in range(5)], "top5_scores": [0.1] * 5,
                    "captions": [2 * i, 2 * i + 1], "error": None})
    (out / "samples" / "big.retrieval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ret))
    suite = {"model": "m", "template_set": "t", "published": [], "sets": [
        {"name": "big", "protocol": "zero-shot classification", "split": "all images", "warnings": [],
         "images": len(rows), "classes": classes, "class_phrases": {n: n for n in names}, "top1": 0.2, "top5": 0.8,
         "mean_per_class": 0.2, "per_class": {}, "samples": "samples/big.zero-shot.jsonl"},
        {"name": "big", "protocol": "retrieval", "split": "all images", "warnings": [], "images": images,
         "captions": 2 * images, "samples": "samples/big.retrieval.jsonl"}]}
    (out / "suite.json").write_text(json.dumps(suite))
    return out


def test_galleries_are_capped_and_each_image_encoded_once(tmp_path):
    gallery = Gallery(thumb_px=32, max_pairs=3, per_pair=2, max_queries=4)
    path = write_html_report(_big_suite(tmp_path / "suite"), gallery)
    page = path.read_text(encoding="utf-8")
    root = parse(page)
    assert len(root.find_all("div", cls="pair")) == 3
    assert all(len(p.find_all("figure")) == 2 for p in root.find_all("div", cls="pair"))
    assert len(root.find_all("div", cls="sample")) == len(root.find_all("div", cls="worst")) == 4
    # pairs 3 x 2, sample 4 x 5, worst 4 x (5 + its own image), worst image queries 4
    imgs = root.find_all("img")
    assert len(imgs) <= 3 * 2 + 4 * 5 + 4 * 6 + 4
    thumbs = thumbnail_map(page)
    assert len(thumbs) - 1 == len({i.attrs["data-thumb"] for i in imgs}) < len(imgs)   # repeats share one entry
    for uri in (u for k, u in thumbs.items() if k != MISSING):
        im = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
        assert im.format == "JPEG" and max(im.size) <= 32
    assert len(page.encode()) < 150_000


@pytest.mark.parametrize("n,c", [(1, 1), (50, 3), (1000, 45)])
def test_confusion_matrix_matches_a_loop(n, c):
    rng = np.random.default_rng(n)
    labels, predicted = rng.integers(0, c, n), rng.integers(0, c, n)
    want = np.zeros((c, c), dtype=np.int64)
    for t, p in zip(labels, predicted):
        want[t, p] += 1
    assert np.array_equal(confusion_matrix(labels, predicted, c), want)


def test_confusion_order_chains_at_both_ends_ties_by_name():
    names = ["a", "b", "c", "d", "e", "f"]
    m = np.zeros((6, 6), dtype=np.int64)
    m[0, 1], m[1, 2], m[3, 0] = 5, 3, 2      # a-b heaviest; b-c at the tail, d-a at the head
    m[4, 4] = 9                              # e: only right answers
    assert [names[i] for i in confusion_order(m, names)] == ["d", "a", "b", "c", "e", "f"]
    tie = np.zeros((4, 4), dtype=np.int64)
    tie[2, 3] = tie[0, 1] = 1                # two equal pairs: the one whose names sort first starts
    assert [names[i] for i in confusion_order(tie, names[:4])] == ["a", "b", "c", "d"]


def test_confusion_order_depends_on_names_not_indices():
    rng = np.random.default_rng(0)
    m = rng.integers(0, 3, (12, 12)) * (rng.random((12, 12)) < 0.3)
    names = [f"class {i:02d}" for i in range(12)]
    order = [names[i] for i in confusion_order(m, names)]
    perm = rng.permutation(12)
    shuffled = [names[i] for i in perm]
    assert [shuffled[i] for i in confusion_order(m[np.ix_(perm, perm)], shuffled)] == order
    assert sorted(order) == names
