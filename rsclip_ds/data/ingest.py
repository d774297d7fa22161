"""Rows of a published corpus (hf_source.py) -> webdataset shards: filtered, parallel, resumable.

One row -> one sample ``{key}.{ext}`` (the image bytes as they are, unless --max-side /
--format / --bands ask for re-encoding) + ``{key}.txt`` (its captions, one per line: every
--caption-column) + ``{key}.json`` ({"filename", "captions", "split", every other column;
numbers stay numbers; a Google_location 'Z_X_Y' adds "latitude"/"longitude" of the tile centre}).
The key is the row number (``000001234``): unique, without dots, the same on every run.

Skipped rows are counted by reason -- ``filtered_out`` (--where), ``caption_length``
(--min/--max-caption-words), ``empty_caption``, ``missing_image``, ``corrupt_image`` -- with the
first examples of each in ``{prefix}-report.json``. ``index.json`` gets the shards, the counts and
per column its type and range (min/max of numbers, distinct-count cap of strings).

At scale. Workers (``workers`` processes) check and re-encode chunks of rows; results are taken in
row order, so the shards are byte-identical for any worker count. A shard is written as
``NAME.tar.partial`` and renamed when complete; after each rename ``{prefix}-progress.json``
(rows consumed, shards, counts, column ranges, the options' fingerprint) is replaced atomically.
A killed conversion rerun with the same command deletes what no progress file vouches for and
continues from the last complete shard: the output equals an uninterrupted run's, byte for byte
(tests/unit/test_ingest.py kills one with SIGKILL).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from rsclip_ds.data.geotiff import BandChoice, is_tiff, to_rgb
from rsclip_ds.data.hf_source import HFSource, tile_centre
from rsclip_ds.data.where import Where

MTIME = 946684800          # 2000-01-01: fixed member time, reproducible tars
SKIP_KINDS = ("filtered_out", "caption_length", "empty_caption", "missing_image", "corrupt_image")
EXAMPLES = 20              # per reason, in the report
_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "TIFF": "tif", "GIF": "gif", "BMP": "bmp"}
_TEXT_CAP = 1000           # distinct strings counted per column (more: ">1000")


@dataclass(frozen=True)
class RowSpec:
    """How a row becomes a sample (what the workers need; picklable)."""
    image_column: str = "image"
    caption_columns: tuple[str, ...] = ("caption",)
    where: str = ""
    min_words: int = 0
    max_words: int = 0                    # 0: no bound
    max_side: int = 0
    format: str = "keep"                  # keep | jpg | png | webp
    quality: int = 95
    bands: BandChoice | None = None
    verify: str = "header"                # header: parse the header, check the end marker; decode: full
    split: str | None = "train"            # the dataset split, written into each sample's JSON
    name_column: str = "img_name"

    def check(self, columns: list[str], label: str) -> None:
        wanted = [self.image_column, *self.caption_columns]
        missing = [c for c in wanted if c not in columns]
        if missing:
            flag = "--image-column" if self.image_column in missing else "--caption-column"
            raise ValueError(f"{label}: no column {missing[0]!r}; its columns: {columns}. Name them with "
                             f"--image-column / --caption-column (comma-separated for several), e.g. {flag}")
        Where.parse(self.where).check_columns(list(columns) + ["latitude", "longitude"], label)


# --------------------------------------------------------------------------- one row (workers)

def _jsonable(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return None   # binary columns other than the image are not metadata
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _image_bytes(value) -> bytes | None:
    if isinstance(value, dict):
        return value.get("bytes") or (Path(value["path"]).read_bytes() if value.get("path") else None)
    return bytes(value) if value else None


def _check_ends(data: bytes, fmt: str) -> None:
    """A truncated JPEG/PNG lacks its end marker: the cheap check that catches cut-off files."""
    tail = data[-16:].rstrip(b"\x00")
    if fmt == "JPEG" and not tail.endswith(b"\xff\xd9"):
        raise OSError("truncated JPEG (no end-of-image marker)")
    if fmt == "PNG" and b"IEND" not in tail:
        raise OSError("truncated PNG (no IEND chunk)")


def encode_image(data: bytes, spec: RowSpec) -> tuple[bytes, str]:
    """-> (bytes, ext): the bytes as they are, or re-encoded. OSError/ValueError when unreadable."""
    from PIL import Image

    if is_tiff(data):
        if spec.bands is None and spec.format == "keep" and not spec.max_side:
            to_rgb(data, None)   # a multi-band or 16-bit TIFF without --bands: BandsError
            return data, "tif"
        img, fmt, too_big = Image.fromarray(to_rgb(data, spec.bands)), "TIFF", False
    else:
        img = Image.open(io.BytesIO(data))
        fmt = img.format
        if spec.verify == "decode":
            img.load()
        else:
            _check_ends(data, fmt)
        too_big = bool(spec.max_side) and max(img.size) > spec.max_side
        ext = _EXT.get(fmt, (fmt or "bin").lower())
        if not too_big and spec.format in ("keep", ext) and ext in ("jpg", "png", "webp"):
            return data, ext
    ext = _EXT.get(fmt, "png")
    out = spec.format if spec.format != "keep" else ("png" if fmt in ("TIFF", "BMP", "GIF") else ext)
    img = img.convert("RGB") if img.mode not in ("RGB", "L") or out == "jpg" else img
    if too_big:
        s = spec.max_side / max(img.size)
        img = img.resize((max(1, round(img.width * s)), max(1, round(img.height * s))), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format={"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[out],
             **({"quality": spec.quality} if out in ("jpg", "webp") else {}))
    return buf.getvalue(), out


def row_sample(index: int, row: dict, spec: RowSpec, where: Where) -> tuple[str, object]:
    """One row -> ('ok', (members {ext: bytes}, meta)) or (skip reason, detail)."""
    from PIL import Image

    captions = []
    for column in spec.caption_columns:
        value = row.get(column)
        for c in (value if isinstance(value, list) else [value]):
            if c is not None and str(c).strip():
                captions.append(" ".join(str(c).split()))
    meta = {k: _jsonable(v) for k, v in row.items() if k != spec.image_column}
    loc = tile_centre(row["Google_location"]) if "Google_location" in row else None
    if loc is not None:
        meta["latitude"], meta["longitude"] = loc
    if where and not where(meta):
        return "filtered_out", where.text
    if not captions:
        return "empty_caption", f"no text in {', '.join(spec.caption_columns)}"
    words = [len(c.split()) for c in captions]
    if (spec.min_words and max(words) < spec.min_words) or (spec.max_words and min(words) > spec.max_words):
        return "caption_length", f"{words} words (bounds {spec.min_words}..{spec.max_words or 'any'})"
    data = _image_bytes(row.get(spec.image_column))
    if not data:
        return "missing_image", f"no bytes in column {spec.image_column!r}"
    try:
        image, ext = encode_image(data, spec)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        return "corrupt_image", f"{type(err).__name__}: {err}"
    name = row.get(spec.name_column)
    info = {"filename": name, "captions": captions, "split": spec.split,
            **{k: v for k, v in meta.items() if k not in ("filename", "captions", "split")}}
    members = {ext: image, "txt": "\n".join(captions).encode("utf-8"),
               "json": json.dumps(info, sort_keys=True, ensure_ascii=False).encode("utf-8")}
    return "ok", (members, meta)


def prepare_chunk(args: tuple[int, dict[str, list], RowSpec]) -> list[tuple[str, object]]:
    """Worker: a columnar chunk of rows starting at row ``start`` -> one result per row."""
    start, columns, spec = args
    where = Where.parse(spec.where)
    names = list(columns)
    n = len(columns[names[0]]) if names else 0
    return [row_sample(start + i, {c: columns[c][i] for c in names}, spec, where) for i in range(n)]


# --------------------------------------------------------------------------- writing (main process)

@dataclass
class Progress:
    """What a resumed conversion continues from: written after every complete shard."""
    fingerprint: dict
    rows_done: int = 0
    samples: int = 0
    shards: list[dict] = field(default_factory=list)         # [{"url", "num_samples", "bytes"}]
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    columns: dict[str, dict] = field(default_factory=dict)
    captions: int = 0

    def skip(self, kind: str, example: str) -> None:
        self.skipped[kind] = self.skipped.get(kind, 0) + 1
        shown = self.examples.setdefault(kind, [])
        if len(shown) < EXAMPLES:
            shown.append(example)

    def observe(self, meta: dict) -> None:
        """Per column: its JSON type and range (numbers) or distinct values up to _TEXT_CAP."""
        for k, v in meta.items():
            kind = "null" if v is None else "bool" if isinstance(v, bool) else "number" \
                if isinstance(v, (int, float)) else "string" if isinstance(v, str) else "other"
            col = self.columns.setdefault(k, {"types": []})
            if kind not in col["types"]:
                col["types"] = sorted(col["types"] + [kind])
            if kind == "number":
                col["min"] = min(col.get("min", v), v)
                col["max"] = max(col.get("max", v), v)
            elif kind == "string":
                seen = col.setdefault("_distinct", [])
                if len(seen) <= _TEXT_CAP and v not in seen:
                    seen.append(v)

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), sort_keys=True))
        os.replace(tmp, path)   # atomic: a kill leaves the old or the new file, never half of one


class AtomicShards:
    """Numbered tars written as NAME.partial and renamed when they close (count or bytes)."""

    def __init__(self, out: Path, prefix: str, max_count: int, max_bytes: float, start: int):
        self.out, self.prefix, self.max_count, self.max_bytes = out, prefix, max_count, max_bytes
        self.number, self.tar, self.entry = start, None, None

    def write(self, key: str, members: dict[str, bytes]) -> dict | None:
        """Add a sample; -> the closed shard's entry when this sample filled it."""
        if self.tar is None:
            name = f"{self.prefix}-{self.number:06d}.tar"
            self.tar = tarfile.open(self.out / (name + ".partial"), "w", format=tarfile.USTAR_FORMAT)
            self.entry = {"url": name, "num_samples": 0, "bytes": 0}
        for ext, data in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), MTIME, 0o444
            self.tar.addfile(info, io.BytesIO(data))
            self.entry["bytes"] += len(data)
        self.entry["num_samples"] += 1
        full = self.entry["num_samples"] >= self.max_count or (self.max_bytes and self.entry["bytes"] >= self.max_bytes)
        return self.close() if full else None

    def close(self) -> dict | None:
        if self.tar is None:
            return None
        self.tar.close()
        name = self.entry["url"]
        os.replace(self.out / (name + ".partial"), self.out / name)
        self.tar, entry = None, self.entry
        self.number += 1
        return entry


def _ordered(chunks, pool: ProcessPoolExecutor | None, window: int):
    """prepare_chunk over ``chunks`` in order, at most ``window`` chunks in flight."""
    if pool is None:
        yield from map(prepare_chunk, chunks)
        return
    pending = deque()
    for chunk in chunks:
        pending.append(pool.submit(prepare_chunk, chunk))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()

