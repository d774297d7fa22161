"""The benchmark suite's visuals in the monitors users already watch: at each suite step of a run,
every classification set's confusion matrix and every retrieval set's gallery of caption queries,
read from the step's folder {output_dir}/eval/step{N:08d}/ (suite.json + samples/, which the
training hook writes before it returns its metrics): no model, no second forward pass.

    visuals = read_step(step_folder(out / "eval", 40))    # None: no folder at that step
    for c in visuals.confusions:
        c.counts(), render_confusion(c)                  # (K, K) [true, predicted]; (H, W, 3) uint8
    for g in visuals.galleries:
        g.rows, render_gallery(g)                        # the sampled caption-query rows; (H, W, 3)
    images = SuiteImages(writer, out / "eval")           # TensorBoard: Suite/<set>/confusion, .../gallery
    images.write(40)

W&B's own types (a confusion-matrix chart, a table of images) are made from the same records in
wandb_log.py. matplotlib is optional (the `plots` extra): without it the renders are None and
SuiteImages says once why TensorBoard gets no images; the scalars are untouched.
"""

from __future__ import annotations

import json
import logging
import random
import textwrap
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("rsclip_ds")

GALLERY_QUERIES = 8    # caption queries per retrieval set and step (W&B table rows, TensorBoard grid rows)
GALLERY_SEED = 0       # a fixed seed: the same queries at every step, so a reader watches them improve
THUMB_PX = 128         # the longer side of a gallery thumbnail
DPI = 100
TOP = 5                # the samples files keep the top 5


def step_folder(eval_dir: str | Path, step: int) -> Path:
    """The suite folder the training hook writes at a suite step."""
    return Path(eval_dir) / f"step{step:08d}"


# --------------------------------------------------------------------------- reading a step folder

@dataclass
class Confusion:
    """One classification set's top-1 predictions: ``labels[i]`` the true class of the i-th readable
    image, ``preds[i]`` its top-1 class; ``classes``: the K class phrases in class-index order."""
    set: str
    classes: list[str]
    labels: list[int]
    preds: list[int]

    def counts(self) -> np.ndarray:
        """(K, K) int64: [true class, predicted class] -> images."""
        k = len(self.classes)
        flat = np.asarray(self.labels, dtype=np.int64) * k + np.asarray(self.preds, dtype=np.int64)
        return np.bincount(flat, minlength=k * k).reshape(k, k)


@dataclass
class Gallery:
    """One retrieval set's sampled caption queries: ``rows`` are the samples file's caption rows
    (caption, image, rank, top5, top5_images, top5_scores), in caption order; ``total``: the readable
    caption queries they were drawn from."""
    set: str
    rows: list[dict[str, Any]]
    total: int


@dataclass
class StepVisuals:
    step: int | None
    folder: Path
    confusions: list[Confusion]
    galleries: list[Gallery]


def read_step(folder: str | Path, *, queries: int = GALLERY_QUERIES, seed: int = GALLERY_SEED) -> StepVisuals | None:
    """A suite folder -> its confusions and galleries; None without a suite.json there. A set that
    could not be scored (its record has "error") has no samples file and is left out; a samples file
    missing from the folder is left out with a warning."""
    from rsclip_ds.evaluation.samples import read_rows
    from rsclip_ds.evaluation.suite import CLASSIFICATION, RETRIEVAL

    folder = Path(folder)
    path = folder / "suite.json"
    if not path.is_file():
        return None
    suite = json.loads(path.read_text(encoding="utf-8"))
    confusions, galleries = [], []
    for record in suite.get("sets", []):
        if "error" in record or not record.get("samples"):
            continue
        samples = folder / record["samples"]
        if not samples.is_file():
            log.warning("suite visuals: %s names %s, which is not there: %s left out", path, samples, record["name"])
            continue
        if record["protocol"] == CLASSIFICATION:
            confusions.append(confusion_of(record, read_rows(samples)))
        elif record["protocol"] == RETRIEVAL:
            gallery = gallery_of(record["name"], read_rows(samples), queries, seed)
            if gallery.rows:   # a set whose images were all unreadable has no query to show
                galleries.append(gallery)
    return StepVisuals(suite.get("step"), folder, confusions, galleries)


def confusion_of(record: dict[str, Any], rows: list[dict[str, Any]]) -> Confusion:
    """A classification record (its class_phrases: class index i is the i-th entry) and its zero-shot
    rows -> the readable images' true and top-1 classes."""
    phrases = list((record.get("class_phrases") or {}).values())
    k = record.get("classes") or len(phrases)
    names = phrases if len(phrases) == k else [f"class {i}" for i in range(k)]
    readable = [r for r in rows if r.get("readable") and r.get("top5")]
    return Confusion(record["name"], unique_names(names), [int(r["label"]) for r in readable],
                     [int(r["top5"][0]) for r in readable])


def gallery_of(name: str, rows: list[dict[str, Any]], queries: int, seed: int) -> Gallery:
    """The seeded sample of ``queries`` readable caption queries of a retrieval set's rows."""
    captions = [r for r in rows if r.get("query") == "caption" and r.get("readable") and r.get("rank") is not None]
    picked = sorted(random.Random(seed).sample(range(len(captions)), min(queries, len(captions))))
    return Gallery(name, [captions[i] for i in picked], len(captions))


def unique_names(names: list[str]) -> list[str]:
    """Two classes with one phrase would share a row of W&B's chart (it groups by name): 'x', 'x (2)'."""
    seen: Counter[str] = Counter()
    out = []
    for n in names:
        seen[n] += 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def thumbnail(path: str | Path, px: int = THUMB_PX):
    """The image at ``path`` as RGB, fitted in px x px (a PIL image); a grey square where it cannot be
    read now (moved since the evaluation, a multispectral GeoTIFF PIL cannot decode)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            im.thumbnail((px, px))
            return im
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        log.debug("suite visuals: %s not shown: %s", path, err)
        return Image.new("RGB", (px, px), (200, 200, 200))


# --------------------------------------------------------------------------- rendering (matplotlib)

def _figure_maker():
    """matplotlib's Figure with an Agg canvas (no pyplot: no global backend, no figure manager),
    or None when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None

    def make(**kw):
        fig = Figure(**kw)
        FigureCanvasAgg(fig)
        return fig
    return make


def plots_available() -> bool:
    return _figure_maker() is not None


# Chinese captions exist in the field: an installed CJK font takes the glyphs DejaVu Sans lacks
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Source Han Sans SC", "WenQuanYi Zen Hei",
             "WenQuanYi Micro Hei", "SimHei", "Microsoft YaHei")


@contextmanager
def _text_style():
    """DejaVu Sans, then any of CJK_FONTS installed (matplotlib falls back along the list glyph by
    glyph). Without a CJK font those glyphs show as boxes, and matplotlib's warning per missing glyph
    is kept out of the training log (the W&B table and report.html carry the text itself)."""
    import matplotlib
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist}
    with matplotlib.rc_context({"font.family": ["DejaVu Sans"] + [f for f in CJK_FONTS if f in installed]}), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font")
        yield


def _pixels(fig) -> np.ndarray:
    """A drawn figure -> (H, W, 3) uint8, H x W = its size in inches x DPI."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def confusion_inches(classes: int) -> float:
    """The square figure's side: room for K labelled rows (0.22 in each), between 5 and 16 inches."""
    return min(16.0, max(5.0, 2.5 + 0.22 * classes))


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def render_confusion(c: Confusion) -> np.ndarray | None:
    """The confusion matrix, each true class's row normalised to sum to 1 (a row without images: 0),
    classes labelled in class-index order (the same cells at every step); the percentages written in
    the cells up to 20 classes. (side x DPI, side x DPI, 3) uint8, side = confusion_inches(K); None
    without matplotlib."""
    make = _figure_maker()
    if make is None:
        return None
    with _text_style():
        return _draw_confusion(make, c)


def _draw_confusion(make, c: Confusion) -> np.ndarray:
    counts = c.counts()
    k = len(c.classes)
    per_class = counts.sum(axis=1, keepdims=True)                                           # (K, 1)
    frac = np.divide(counts, per_class, out=np.zeros(counts.shape), where=per_class > 0)    # (K, K)
    side = confusion_inches(k)
    fig = make(figsize=(side, side), dpi=DPI)
    ax = fig.subplots()
    ax.imshow(frac, cmap="Blues", vmin=0, vmax=1)
    size = 8 if k <= 30 else 6
    labels = [_short(n, 24) for n in c.classes]
    ax.set_xticks(range(k), labels, rotation=90, fontsize=size)
    ax.set_yticks(range(k), labels, fontsize=size)
    if k <= 20:
        for (i, j), v in np.ndenumerate(frac):
            if counts[i, j]:
                ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=size,
                        color="white" if v > 0.5 else "black")
    n = int(counts.sum())
    top1 = np.trace(counts) / n if n else 0.0
    ax.set_xlabel("predicted (top-1)")
    ax.set_ylabel("true class")
    ax.set_title(f"{c.set}: {n} images, top-1 {100 * top1:.1f}% (each row sums to 100%)", fontsize=9)
    fig.tight_layout()
    return _pixels(fig)


GALLERY_TEXT_IN, GALLERY_CELL_IN, GALLERY_ROW_IN, GALLERY_HEAD_IN = 3.0, 1.5, 1.7, 0.5


def gallery_inches(rows: int) -> tuple[float, float]:
    """(width, height): a caption column, the correct image and the top 5, one row per query."""
    return GALLERY_TEXT_IN + (1 + TOP) * GALLERY_CELL_IN, GALLERY_HEAD_IN + rows * GALLERY_ROW_IN


def render_gallery(g: Gallery, px: int = THUMB_PX) -> np.ndarray | None:
    """One row per sampled caption query: the caption and its rank, its correct image, then the top-5
    retrieved images with their scores, the correct one framed in green. (height x DPI, width x DPI, 3)
    uint8 from gallery_inches(len(g.rows)); None without matplotlib."""
    make = _figure_maker()
    if make is None or not g.rows:
        return None
    with _text_style():
        return _draw_gallery(make, g, px)


def _draw_gallery(make, g: Gallery, px: int) -> np.ndarray:
    width, height = gallery_inches(len(g.rows))
    fig = make(figsize=(width, height), dpi=DPI)
    axes = fig.subplots(len(g.rows), 2 + TOP, squeeze=False,
                        gridspec_kw={"width_ratios": [GALLERY_TEXT_IN / GALLERY_CELL_IN] + [1] * (1 + TOP)})
    thumbs: dict[str, Any] = {}   # an image in several rows is read once

    def show(ax, path: str, title: str, correct: bool) -> None:
        if path not in thumbs:
            thumbs[path] = np.asarray(thumbnail(path, px))
        ax.imshow(thumbs[path])
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(title, fontsize=7)
        for spine in ax.spines.values():
            spine.set_edgecolor("tab:green" if correct else "0.8")
            spine.set_linewidth(3 if correct else 0.5)

    for row, r in zip(axes, g.rows):
        text = "\n".join(textwrap.wrap(r["caption"], 40)[:5])
        row[0].axis("off")
        row[0].text(0, 0.5, f"{text}\n\nrank {r['rank']}", fontsize=7, va="center", ha="left",
                    transform=row[0].transAxes)
        show(row[1], r["image"], "its image", True)
        for j, ax in enumerate(row[2:]):
            if j < len(r["top5_images"]):
                show(ax, r["top5_images"][j], f"#{j + 1}  {r['top5_scores'][j]:.2f}", r["top5"][j] == r["image_index"])
            else:   # a set with fewer than 5 readable images
                ax.axis("off")
    fig.suptitle(f"{g.set}: {len(g.rows)} of {g.total} caption queries (seeded sample); correct image in green",
                 fontsize=9)
    fig.tight_layout()
    return _pixels(fig)


# --------------------------------------------------------------------------- TensorBoard

def tensorboard_writer(monitor):
    """The SummaryWriter of DeepSpeed's TensorBoard monitor in a MonitorMaster (rank 0, with
    logging.tensorboard or a profile's own `tensorboard` section), else None. The images go through
    that writer, into its event file: TensorBoard's loader reads a folder's event files one after
    another and stops polling a file once a newer one appears, so a second writer in the folder
    would freeze DeepSpeed's scalars in a live TensorBoard."""
    tb = getattr(monitor, "tb_monitor", None)
    return getattr(tb, "summary_writer", None) if tb is not None and tb.enabled else None


class SuiteImages:
    """TensorBoard images at each suite step: ``Suite/<set>/confusion`` (render_confusion) per
    classification set and ``Suite/<set>/gallery`` (render_gallery) per retrieval set, at the
    optimizer step. ``writer``: a torch.utils.tensorboard SummaryWriter (tensorboard_writer);
    close() closes it at the end of the run. Without matplotlib or without the step's folder,
    one log line says so (once each) and nothing is written."""

    def __init__(self, writer, eval_dir: str | Path):
        self.writer, self.eval_dir = writer, Path(eval_dir)
        self._said: set[str] = set()

    def _say_once(self, what: str, message: str, *args) -> None:
        if what not in self._said:
            self._said.add(what)
            log.info(message, *args)

    def write(self, step: int) -> list[str]:
        """-> the tags written."""
        folder = step_folder(self.eval_dir, step)
        if not plots_available():
            self._say_once("matplotlib", "TensorBoard: no suite images (confusion matrices, retrieval galleries): "
                           "matplotlib is not installed (pip install 'rsclip-ds[plots]'); the scalars are logged")
            return []
        visuals = read_step(folder)
        if visuals is None:
            self._say_once("folder", "TensorBoard: no suite images at step %d: %s has no suite.json", step, folder)
            return []
        tags = []
        for tag, image in ([(f"Suite/{c.set}/confusion", render_confusion(c)) for c in visuals.confusions]
                           + [(f"Suite/{g.set}/gallery", render_gallery(g)) for g in visuals.galleries]):
            self.writer.add_image(tag, image, step, dataformats="HWC")
            tags.append(tag)
        self.writer.flush()
        return tags

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
