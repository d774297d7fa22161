"""Synthetic overhead-imagery-like image/caption shards, for tests, demos and tiny runs.

Each picture is a land-cover texture (one of ``LAND_COVER_CLASSES``) with one or two coloured
shapes at named positions; the caption says exactly that, so a small model can learn the
pairing and retrieval / zero-shot accuracy become measurable:

    rsclip-ds make-synthetic data/synth      # ~2 s for 2048 + 256 samples at 64 px
    -> "an aerial image of farmland with a red round storage tank in the top left."

Every sample draws from its own rng seeded by (seed, split, index), so the pixels do not
depend on the shard size, and the tars carry a fixed mtime: the same seed gives byte-identical
shards.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw
from rich.progress import Progress
from webdataset import TarWriter

LAND_COVER_CLASSES = ["water", "forest", "farmland", "desert", "residential area", "snowfield",
                      "grassland", "bare rock"]
# (adjective used in captions, noun, how it is drawn)
SHAPES = [("square", "building", "square"), ("round", "storage tank", "circle"),
          ("triangular", "roof", "triangle"), ("cross-shaped", "road junction", "cross")]
COLORS = {"red": (220, 30, 30), "yellow": (240, 220, 20), "white": (250, 250, 250),
          "black": (15, 15, 15), "orange": (250, 140, 0), "purple": (150, 40, 200)}
POSITIONS = {"top left": (0.25, 0.25), "top right": (0.75, 0.25), "bottom left": (0.25, 0.75),
             "bottom right": (0.75, 0.75), "center": (0.5, 0.5)}
TEMPLATES = ["an aerial image of {lc} with {objs}.", "a satellite photo of {lc} showing {objs}.",
             "overhead view of {lc}; there is {objs}.", "{objs} on {lc}, seen from above."]
_SPLIT_IDS = {"train": 0, "val": 1}
_MTIME = 946684800  # 2000-01-01: a fixed tar member time makes the shards reproducible


# --------------------------------------------------------------------------- textures

def _smooth_noise(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    """Value noise in [0, 1]: a (cells, cells) random grid upsampled bicubically."""
    grid = rng.random((cells, cells), dtype=np.float32)
    up = Image.fromarray(grid).resize((size, size), Image.Resampling.BICUBIC)
    return np.clip(np.asarray(up), 0.0, 1.0)  # (S, S)


def _tint(base: tuple[int, int, int], amount: np.ndarray, delta: tuple[int, int, int]) -> np.ndarray:
    """base colour + amount (S, S) x delta colour -> (S, S, 3) float."""
    return np.asarray(base, np.float32) + amount[..., None] * np.asarray(delta, np.float32)


def _water(rng, yy, xx, s):
    freq, phase = rng.uniform(0.3, 0.6), rng.uniform(0, 2 * np.pi)
    waves = 0.5 + 0.5 * np.sin(freq * (xx + 0.5 * yy) + phase + 2 * _smooth_noise(rng, s, 4))
    return _tint((20, 60, 140), waves, (30, 50, 60))


def _forest(rng, yy, xx, s):
    canopy = 0.6 * _smooth_noise(rng, s, max(2, s // 4)) + 0.4 * rng.random((s, s), dtype=np.float32)
    return _tint((15, 60, 20), canopy, (40, 60, 25))


def _farmland(rng, yy, xx, s):
    width = rng.integers(4, 9)
    coord = [yy, xx, xx + yy][rng.integers(0, 3)]  # horizontal, vertical or diagonal fields
    stripes = ((coord // width) % 2).astype(np.float32)
    return _tint((110, 150, 40), stripes, (90, 30, -20)) + 10 * rng.random((s, s, 1), dtype=np.float32)


def _desert(rng, yy, xx, s):
    dunes = 0.5 + 0.5 * np.sin(0.25 * yy + 3 * _smooth_noise(rng, s, 3))
    return _tint((200, 170, 110), dunes, (35, 30, 25)) + 8 * rng.random((s, s, 1), dtype=np.float32)


def _residential(rng, yy, xx, s):
    block = rng.integers(6, 11)
    street = ((yy % block) < 2) | ((xx % block) < 2)
    roofs = _smooth_noise(rng, s, max(2, s // 6))
    img = _tint((110, 100, 95), roofs, (60, 50, 40))
    img[street] = (185, 185, 185)
    return img


def _snowfield(rng, yy, xx, s):
    return _tint((225, 232, 245), _smooth_noise(rng, s, 5), (25, 20, 10))


def _grassland(rng, yy, xx, s):
    grass = 0.5 * _smooth_noise(rng, s, 6) + 0.5 * rng.random((s, s), dtype=np.float32)
    return _tint((110, 170, 70), grass, (40, 40, 20))


def _bare_rock(rng, yy, xx, s):
    cracks = np.abs(_smooth_noise(rng, s, 8) - 0.5) < 0.04
    img = _tint((125, 110, 95), _smooth_noise(rng, s, 5), (50, 45, 40))
    img[cracks] = (70, 60, 55)
    return img


_TEXTURES: dict[str, Callable] = dict(zip(LAND_COVER_CLASSES, [
    _water, _forest, _farmland, _desert, _residential, _snowfield, _grassland, _bare_rock]))


# --------------------------------------------------------------------------- objects

def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, fill) -> None:
    if kind == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=(40, 40, 40))
    elif kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=(40, 40, 40))
    elif kind == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill, outline=(40, 40, 40))
    else:  # cross: two bars a third of the size wide
        w = max(1.0, r / 3)
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)


def _pick_objects(rng: np.random.Generator) -> list[dict]:
    count = int(rng.integers(1, 3))
    positions = rng.choice(len(POSITIONS), size=count, replace=False)  # never two in one place
    names = list(POSITIONS)
    return [{"shape": SHAPES[rng.integers(len(SHAPES))][0],
             "color": list(COLORS)[rng.integers(len(COLORS))],
             "position": names[p]} for p in positions]


def _object_phrase(obj: dict) -> str:
    noun = {adj: noun for adj, noun, _ in SHAPES}[obj["shape"]]
    article = "an" if obj["color"][0] in "aeiou" else "a"
    return f"{article} {obj['color']} {obj['shape']} {noun} in the {obj['position']}"


def render_sample(rng: np.random.Generator, size: int = 64) -> tuple[Image.Image, str, dict]:
    """One (image, caption, labels) triple; fully determined by ``rng``.

    labels: {"land_cover": str, "land_cover_id": int, "objects": [{"shape", "color", "position"}],
    "template": int}.
    """
    lc_id = int(rng.integers(len(LAND_COVER_CLASSES)))
    land_cover = LAND_COVER_CLASSES[lc_id]
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)  # (S, S) each
    pixels = _TEXTURES[land_cover](rng, yy, xx, size)  # (S, S, 3) float
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")

    objects = _pick_objects(rng)
    draw = ImageDraw.Draw(image)
    kinds = {adj: kind for adj, _, kind in SHAPES}
    for obj in objects:
        fx, fy = POSITIONS[obj["position"]]
        jitter = rng.uniform(-size / 20, size / 20, size=2)
        _draw_shape(draw, kinds[obj["shape"]], fx * size + jitter[0], fy * size + jitter[1],
                    size * rng.uniform(0.08, 0.13), COLORS[obj["color"]])

    template = int(rng.integers(len(TEMPLATES)))
    labels = {"land_cover": land_cover, "land_cover_id": lc_id, "objects": objects, "template": template}
    return image, caption_for(labels, template), labels


def caption_for(labels: dict, template: int) -> str:
    """The caption of ``labels`` written with ``TEMPLATES[template]``."""
    objs = " and ".join(_object_phrase(o) for o in labels["objects"])
    caption = TEMPLATES[template].format(lc=labels["land_cover"], objs=objs)
    return caption[0].upper() + caption[1:] if template == 3 else caption


# --------------------------------------------------------------------------- shards

def sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """Per-sample generator: independent of shard size and of the other samples."""
    return np.random.default_rng([seed, _SPLIT_IDS[split], index])


def _encode(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _write_split(out_dir: Path, split: str, num: int, shard_size: int, image_size: int, seed: int,
                 advance: Callable[[], None]) -> list[dict]:
    shards = []
    for shard_id, start in enumerate(range(0, num, shard_size)):
        name = f"{split}-{shard_id:06d}.tar"
        stop = min(num, start + shard_size)
        # encoder=False: we hand over bytes; keys have no dots (webdataset splits at the first dot)
        with TarWriter(str(out_dir / name), encoder=False, mtime=_MTIME) as sink:
            for index in range(start, stop):
                image, caption, labels = render_sample(sample_rng(seed, split, index), image_size)
                sink.write({"__key__": f"{split}_{index:07d}", "jpg": _encode(image),
                            "txt": caption.encode("utf-8"),
                            "json": json.dumps(labels, sort_keys=True).encode("utf-8")})
                advance()
        shards.append({"url": name, "num_samples": stop - start})
    return shards


def class_folder_name(land_cover: str) -> str:
    """'residential area' -> 'ResidentialArea' (the AID / EuroSAT folder style)."""
    return "".join(word.capitalize() for word in land_cover.split())


def _write_eval_layout(out_dir: Path, num: int, image_size: int, seed: int,
                       advance: Callable[[], None]) -> dict:
    """The val samples again, as the two layouts evaluation reads:
    eval/classes/<LandCover>/<key>.jpg (zero-shot) and eval/captions.json + eval/images/ (a
    Karpathy-style caption file, split "test", one caption per template = several per image)."""
    root = out_dir / "eval"
    (root / "images").mkdir(parents=True, exist_ok=True)
    for name in LAND_COVER_CLASSES:
        (root / "classes" / class_folder_name(name)).mkdir(parents=True, exist_ok=True)
    images, sentid = [], 0
    for index in range(num):
        image, _, labels = render_sample(sample_rng(seed, "val", index), image_size)
        key, data = f"val_{index:07d}", _encode(image)
        (root / "images" / f"{key}.jpg").write_bytes(data)
        (root / "classes" / class_folder_name(labels["land_cover"]) / f"{key}.jpg").write_bytes(data)
        sentences = []
        for template in range(len(TEMPLATES)):
            raw = caption_for(labels, template)
            sentences.append({"raw": raw, "tokens": re.findall(r"[a-z-]+", raw.lower()),
                              "imgid": index, "sentid": sentid + template})
        images.append({"filename": f"{key}.jpg", "imgid": index, "split": "test",
                       "sentences": sentences, "sentids": [s["sentid"] for s in sentences]})
        sentid += len(sentences)
        advance()
    (root / "captions.json").write_text(json.dumps({"dataset": "synthetic", "images": images}) + "\n")
    return {"classes_dir": "eval/classes", "captions_json": "eval/captions.json", "images_dir": "eval/images"}


def _brace_pattern(out_dir: Path, split: str, count: int) -> str:
    return str(out_dir / f"{split}-{{000000..{count - 1:06d}}}.tar")


def make_synthetic(out_dir: str | Path, *, num_train: int = 2048, num_val: int = 256,
                   shard_size: int = 256, image_size: int = 64, seed: int = 0,
                   progress: bool = True, eval_layout: bool = False) -> dict:
    """Write train/val shards and ``index.json`` into ``out_dir``; return the index.

    The returned dict is index.json plus "train_pattern" / "val_pattern": brace patterns with the
    full path, ready for ``data.train_shards``. ``eval_layout``: also write the val split as a
    class-folder tree and a caption JSON (see ``_write_eval_layout``); index.json then gets an
    "eval" entry and the dict "zero_shot_dir" / "retrieval_json" (full paths).
    """
    if num_train < 1 or num_val < 1 or shard_size < 1 or image_size < 8:
        raise ValueError(f"make_synthetic needs num_train, num_val, shard_size >= 1 and image_size >= 8 "
                         f"(got {num_train}, {num_val}, {shard_size}, {image_size})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index: dict = {"seed": seed, "image_size": image_size}
    with Progress(disable=not progress, transient=True) as bar:
        for split, num in (("train", num_train), ("val", num_val)):
            task = bar.add_task(f"synthetic {split}", total=num)
            index[split] = _write_split(out, split, num, shard_size, image_size, seed,
                                        lambda t=task: bar.advance(t))
        if eval_layout:
            task = bar.add_task("synthetic eval layout", total=num_val)
            index["eval"] = _write_eval_layout(out, num_val, image_size, seed, lambda t=task: bar.advance(t))
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    patterns = {f"{s}_pattern": _brace_pattern(out, s, len(index[s])) for s in ("train", "val")}
    if eval_layout:
        patterns.update(zero_shot_dir=str(out / index["eval"]["classes_dir"]),
                        retrieval_json=str(out / index["eval"]["captions_json"]))
    return {**index, **patterns}
