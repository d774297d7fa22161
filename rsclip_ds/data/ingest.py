"""Rows of a published corpus (hf_source.py) -> webdataset shards: filtered, parallel, resumable.

One row -> one sample ``{key}.{ext}`` (the image bytes as they are, unless --max-side /
--format / --bands ask for re-encoding) + ``{key}.txt`` (its captions, one per line: every
--caption-column) + ``{key}.json`` ({"filename", "captions", "split", every other column;
numbers stay numbers, float32 ones in their shortest form; a Google_location 'Z_X_Y' adds "latitude"/"longitude" of the tile centre}).
The key is the row number (``000001234``): unique, without dots, the same on every run.

Skipped rows are counted by reason -- ``filtered_out`` (--where), ``caption_length``
(--min/--max-caption-words), ``empty_caption``, ``missing_image``, ``corrupt_image`` -- with the
first examples of each in ``{prefix}-report.json``. ``index.json`` gets the shards, the counts and
per column its type and range (min/max of numbers, distinct-count cap of strings).

At scale. Workers (``workers`` processes) turn chunks of rows into tar blocks (captions, JSON,
member headers) and check or re-encode the images that need a decoder; an image the header check
settles (image_check.py: JPEG/PNG/WebP copied as they are, ``--verify header``) is checked in the
main process and its bytes never travel to a worker. Results are taken in row order, so the
shards are byte-identical for any worker count. A shard is written as
``NAME.tar.partial`` and renamed when complete; after each rename ``{prefix}-progress.json``
(rows consumed, shards, counts, column ranges, the options' fingerprint) is replaced atomically.
A killed conversion rerun with the same command deletes what no progress file vouches for and
continues from the last complete shard: the output equals an uninterrupted run's, byte for byte
(tests/unit/test_corpora.py kills one with SIGKILL).
"""

from __future__ import annotations

import json
import math
import os
import tarfile
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rsclip_ds.data.geotiff import BandChoice
from rsclip_ds.data.hf_source import tile_centre
from rsclip_ds.data.image_check import Checked, encode_image, image_bytes, precheck
from rsclip_ds.data.near_duplicates import HASH_ERRORS, image_hashes
from rsclip_ds.data.where import Where

MTIME = 946684800          # 2000-01-01: fixed member time, reproducible tars
SKIP_KINDS = ("filtered_out", "caption_length", "empty_caption", "missing_image", "corrupt_image",
              "near_evaluation")   # the last: --exclude-near (convert.py drops what the worker's hash matches)
EXAMPLES = 20              # per reason, in the report
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
    float32_columns: tuple[str, ...] = ()  # written as their shortest float32 form (0.98, not 0.98000001907)
    near_hash: bool = False                # --exclude-near: pHash every image (near_duplicates.image_hashes)

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


def shortest_float32(value):
    """A float32 column's value (arrow gives the float64 of the float32: 0.9800000190734863) ->
    the shortest decimal that is the same float32 (0.98), as the dataset viewer shows it."""
    return float(str(np.float32(value))) if isinstance(value, float) and math.isfinite(value) else value


def _tarfile_header(name: str, size: int) -> bytes:
    """The 512-byte ustar header tarfile writes for a member (fixed time and mode)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, MTIME, 0o444
    return info.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape")


# tarfile's header of a member named 'a' of 0 bytes, with the name, size and checksum fields
# blanked (the checksum field counts as 8 spaces): _tar_header fills them in
_TEMPLATE = bytearray(_tarfile_header("a", 0))
_TEMPLATE[0:100], _TEMPLATE[124:136], _TEMPLATE[148:156] = bytes(100), b"00000000000\0", b" " * 8


def _tar_header(name: str, size: int) -> bytes:
    """_tarfile_header's bytes, from a template: a tenth of tarfile's Python per member (a
    third of a row's time in the bare loop went there); tests/unit/test_corpora.py checks
    equality. Names that are long or not ASCII, and sizes past ustar's, go to tarfile."""
    if len(name) > 100 or not name.isascii() or size >= 8 ** 11:
        return _tarfile_header(name, size)
    buf = bytearray(_TEMPLATE)
    buf[0:len(name)] = name.encode("ascii")
    buf[124:135] = b"%011o" % size
    buf[148:155] = b"%06o\0" % sum(buf)
    return bytes(buf)


def _pad(size: int) -> bytes:
    return b"\0" * (-size % tarfile.BLOCKSIZE)


def row_sample(index: int, row: dict, spec: RowSpec, where: Where) -> tuple[str, object]:
    """One row -> ('ok', (head, image, tail, meta, captions, text bytes, hashes)) or (skip reason, detail).

    The sample as tar blocks: ``head`` (the image member's header), the image bytes, ``tail``
    (their padding, then the .txt and .json members, headers included), so that the writer only
    concatenates them. ``image`` is None when the main process checked the image and kept its
    bytes (the row's image column then holds an image_check.Checked). ``hashes``: with
    ``spec.near_hash`` (coarse, fine, the row's name) of the image as written, else None."""
    from PIL import Image

    captions = []
    for column in spec.caption_columns:
        value = row.get(column)
        for c in (value if isinstance(value, list) else [value]):
            if c is not None and str(c).strip():
                captions.append(" ".join(str(c).split()))
    meta = {k: _jsonable(v) for k, v in row.items() if k != spec.image_column}
    for k in spec.float32_columns:
        meta[k] = shortest_float32(meta.get(k))
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
    value = row.get(spec.image_column)
    if isinstance(value, Checked):
        if value.problem:
            return value.problem
        image, ext, size = None, value.ext, value.size
    else:
        data = image_bytes(value)
        if not data:
            return "missing_image", f"no bytes in column {spec.image_column!r}"
        try:
            image, ext = encode_image(data, spec.format, spec.verify, spec.max_side, spec.quality, spec.bands)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
            return "corrupt_image", f"{type(err).__name__}: {err}"
        size = len(image)
    name = row.get(spec.name_column)
    hashes = None
    if spec.near_hash:   # split_images shipped the bytes: image is never None here
        try:
            hashes = (*image_hashes(image), name)
        except HASH_ERRORS as err:   # passed the header check, does not decode
            return "corrupt_image", f"{type(err).__name__}: {err}"
    info = {"filename": name, "captions": captions, "split": spec.split,
            **{k: v for k, v in meta.items() if k not in ("filename", "captions", "split")}}
    key, tail, text_bytes = f"{index:09d}", [_pad(size)], 0
    for ext_, data in (("txt", "\n".join(captions).encode("utf-8")),
                       ("json", json.dumps(info, sort_keys=True, ensure_ascii=False).encode("utf-8"))):
        tail += [_tar_header(f"{key}.{ext_}", len(data)), data, _pad(len(data))]
        text_bytes += len(data)
    return "ok", (_tar_header(f"{key}.{ext}", size), image, b"".join(tail), meta, len(captions), text_bytes, hashes)


def prepare_chunk(args: tuple[int, dict[str, list], RowSpec]) -> tuple[list[tuple[str, object]], dict]:
    """Worker: a columnar chunk of rows starting at row ``start`` -> (one result per row, the
    column statistics of its samples: observe()). A sample's metadata stays in the worker."""
    start, columns, spec = args
    where = Where.parse(spec.where)
    names = list(columns)
    n = len(columns[names[0]]) if names else 0
    results, stats = [], {}
    for i in range(n):
        status, value = row_sample(start + i, {c: columns[c][i] for c in names}, spec, where)
        if status == "ok":
            observe(stats, value[3])
            value = (*value[:3], *value[4:])    # (head, image, tail, captions, text bytes, hashes)
        results.append((status, value))
    for col in stats.values():
        col.pop("_set", None)   # observe()'s lookup aid; the list travels
    return results, stats


def _kind(v) -> str:
    return "null" if v is None else "bool" if isinstance(v, bool) else "number" \
        if isinstance(v, (int, float)) else "string" if isinstance(v, str) else "other"


def observe(columns: dict[str, dict], meta: dict) -> None:
    """Per column of ``meta`` into ``columns``: its JSON types, the range of its numbers, its
    distinct strings in first-seen order up to _TEXT_CAP + 1 (then: more than the cap)."""
    for k, v in meta.items():
        kind, col = _kind(v), columns.get(k)
        if col is None:
            col = columns[k] = {"types": []}
        if kind not in col["types"]:
            col["types"] = sorted(col["types"] + [kind])
        if kind == "number":
            if "min" not in col or v < col["min"]:
                col["min"] = v
            if "max" not in col or v > col["max"]:
                col["max"] = v
        elif kind == "string":
            seen = col.setdefault("_distinct", [])
            if len(seen) <= _TEXT_CAP and v not in col.setdefault("_set", set()):
                col["_set"].add(v)
                seen.append(v)


def split_images(start: int, columns: dict[str, list], spec: RowSpec) -> tuple[tuple, list[bytes | None]]:
    """The main process's side of a chunk: (what a worker gets, the image bytes kept here).
    Images that the header check settles (image_check.precheck) are replaced by their Checked
    in the worker's columns, so their bytes never travel; the others travel as they are (all of
    them with ``spec.near_hash``: the worker decodes each to hash it)."""
    col = spec.image_column
    kept, shipped = [], []
    for value in columns[col]:
        data = image_bytes(value)
        checked = None if spec.near_hash else precheck(data, spec.format, spec.verify, spec.max_side, col)
        kept.append(data if checked is not None else None)
        shipped.append(checked if checked is not None else value)
    return (start, {**columns, col: shipped}, spec), kept


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
    near_pairs: list[dict] = field(default_factory=list)    # --exclude-near: each dropped row's matches

    def __post_init__(self):
        # the distinct strings per column as a set too (the saved list stays in first-seen order)
        self._seen = {k: set(c["_distinct"]) for k, c in self.columns.items() if "_distinct" in c}

    def skip(self, kind: str, example: str) -> None:
        self.skipped[kind] = self.skipped.get(kind, 0) + 1
        shown = self.examples.setdefault(kind, [])
        if len(shown) < EXAMPLES:
            shown.append(example)

    def merge(self, chunk: dict[str, dict]) -> None:
        """A chunk's column statistics (observe()) into the run's. Idempotent (types and ranges,
        the distinct strings as a set): a chunk merged before a resume and again after it, when
        a shard closed inside it, changes nothing."""
        for k, c in chunk.items():
            col = self.columns.get(k)
            if col is None:
                col = self.columns[k] = {"types": []}
            if set(c["types"]) - set(col["types"]):
                col["types"] = sorted(set(col["types"]) | set(c["types"]))
            if "min" in c:
                col["min"] = c["min"] if "min" not in col else min(col["min"], c["min"])
                col["max"] = c["max"] if "max" not in col else max(col["max"], c["max"])
            if "_distinct" in c:
                seen, known = col.setdefault("_distinct", []), self._seen.setdefault(k, set())
                for v in c["_distinct"]:
                    if len(seen) > _TEXT_CAP:
                        break
                    if v not in known:
                        known.add(v)
                        seen.append(v)

    def save(self, path: Path) -> None:
        state = {name: getattr(self, name) for name in ("fingerprint", "rows_done", "samples", "shards",
                                                        "skipped", "examples", "columns", "captions",
                                                        "near_pairs")}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        os.replace(tmp, path)   # atomic: a kill leaves the old or the new file, never half of one


class AtomicShards:
    """Numbered tars written as NAME.partial and renamed when they close (count or bytes). A
    sample arrives as its tar blocks (row_sample); the end of archive is written as tarfile
    writes it (two zero blocks, zeros to a whole record), so the bytes equal tarfile's."""

    def __init__(self, out: Path, prefix: str, max_count: int, max_bytes: float, start: int):
        self.out, self.prefix, self.max_count, self.max_bytes = out, prefix, max_count, max_bytes
        self.number, self.tar, self.entry, self.offset = start, None, None, 0

    def write(self, blocks: tuple[bytes, ...], payload: int) -> dict | None:
        """Add a sample (its tar blocks; ``payload``: its members' bytes without headers and
        padding); -> the closed shard's entry when this sample filled it."""
        if self.tar is None:
            name = f"{self.prefix}-{self.number:06d}.tar"
            self.tar = open(self.out / (name + ".partial"), "wb", buffering=0)
            self.entry, self.offset = {"url": name, "num_samples": 0, "bytes": 0}, 0
        _write_all(self.tar.fileno(), blocks)   # one system call per sample, the image not copied
        self.offset += sum(len(b) for b in blocks)
        self.entry["bytes"] += payload
        self.entry["num_samples"] += 1
        full = self.entry["num_samples"] >= self.max_count or (self.max_bytes and self.entry["bytes"] >= self.max_bytes)
        return self.close() if full else None

    def close(self) -> dict | None:
        if self.tar is None:
            return None
        end = 2 * tarfile.BLOCKSIZE
        _write_all(self.tar.fileno(), [b"\0" * (end + (-(self.offset + end) % tarfile.RECORDSIZE))])
        self.tar.close()
        name = self.entry["url"]
        os.replace(self.out / (name + ".partial"), self.out / name)
        self.tar, entry = None, self.entry
        self.number += 1
        return entry


def _write_all(fd: int, blocks) -> None:
    """os.writev until every byte is written (a regular file may take fewer at a time)."""
    views = [memoryview(b) for b in blocks if len(b)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _ordered(chunks, pool: ProcessPoolExecutor | None, window: int):
    """prepare_chunk over ``chunks`` ((worker args, images kept here) pairs) in order, at most
    ``window`` chunks in flight -> (results, images kept here) per chunk."""
    if pool is None:
        for args, kept in chunks:
            yield prepare_chunk(args), kept
        return
    pending = deque()
    for args, kept in chunks:
        pending.append((pool.submit(prepare_chunk, args), kept))
        if len(pending) >= window:
            future, kept_ = pending.popleft()
            yield future.result(), kept_
    while pending:
        future, kept_ = pending.popleft()
        yield future.result(), kept_
