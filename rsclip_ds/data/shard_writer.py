"""`rsclip-ds make-shards`: caption datasets as users have them -> webdataset shards + index.

Three inputs (docs/guides/data.md has examples):
  --karpathy dataset_rsicd.json --images DIR    RSICD / UCM / Sydney / RSITMD caption JSON:
                                                images[].filename, .split, .sentences[].raw
  --table captions.csv|.jsonl [--images DIR]    one row per (image, caption); columns named by
                                                --path-column / --caption-column [/ --split-column]
  --folder DIR                                  images with sidecar captions (a.jpg + a.txt,
                                                one caption per line)

Every image becomes one sample ``{key}.{jpg|png|tif|...}`` + ``{key}.txt`` (all its captions,
one per line; the loader draws one per epoch) + ``{key}.json`` ({"filename", "captions",
"split"}). Shards close at --shard-size samples or --shard-bytes bytes, whichever comes first.
``index.json`` in --out lists every shard with its sample count (merged with what other splits
wrote there); ``{prefix}-report.json`` lists every input that was skipped and why
("skipped_paths": {kind: ["path: reason", ...]}).

Same input and options -> byte-identical shards: inputs keep their file order, tar members
carry a fixed mtime/owner, and re-encoding is deterministic. Images are copied as they are, or
re-encoded (--max-side, --format); .tif is read with PIL (8-bit RGB/L), multi-band or 16-bit
GeoTIFFs with --bands (geotiff.py: three bands scaled to 8-bit, written as PNG). --table rows
keep their other columns in the JSON (numbers as numbers) and --where filters on them
(where.py). Published corpora with the image bytes in a parquet/arrow column go through
``--hf-dataset`` instead (hf_source.py, ingest.py, convert.py: streamed, resumable).
``--exclude-near`` drops images near evaluation images (near_duplicates.py; the pairs in the report).
"""

from __future__ import annotations

import csv
import io
import json
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from webdataset import TarWriter

from rsclip_ds.data.geotiff import BandChoice, is_tiff, to_rgb
from rsclip_ds.data.near_duplicates import HASH_ERRORS, NearIndex, image_hashes
from rsclip_ds.data.where import Where

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".tif", ".tiff", ".bmp")
_MTIME = 946684800    # 2000-01-01: fixed member time, reproducible tars
_EXT = {"jpeg": "jpg", "tiff": "tif"}
_PIL_FORMAT = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}
_LOADER_EXTS = ("jpg", "png", "webp", "tif")   # in data.image_key's default


@dataclass
class Record:
    """One image with all its captions, before reading."""
    path: Path
    captions: list[str]
    split: str | None = None
    meta: dict = field(default_factory=dict)     # the table row's other columns


@dataclass
class ShardReport:
    samples: int = 0
    shards: list[dict] = field(default_factory=list)          # [{"url", "num_samples", "bytes"}]
    skipped: dict[str, list[str]] = field(default_factory=dict)  # kind -> paths

    def skip(self, kind: str, path: str) -> None:
        self.skipped.setdefault(kind, []).append(path)


# --------------------------------------------------------------------------- readers

def _captions(raw) -> list[str]:
    items = raw if isinstance(raw, list) else [raw]
    return [" ".join(str(c).split()) for c in items if c is not None and str(c).strip()]


def read_karpathy(path: Path, images: Path, splits: set[str] | None) -> Iterator[Record]:
    """RSICD-style caption JSON; ``filepath`` (COCO) is a sub-folder when present."""
    data = json.loads(Path(path).read_text())
    if "images" not in data:
        raise ValueError(f"{path}: no 'images' list; a Karpathy caption JSON looks like "
                         '{"images": [{"filename": ..., "split": ..., "sentences": [{"raw": ...}]}]}')
    for entry in data["images"]:
        split = entry.get("split")
        if splits and split not in splits:
            continue
        folder = images / entry["filepath"] if entry.get("filepath") else images
        yield Record(folder / entry["filename"], _captions([s.get("raw") for s in entry.get("sentences", [])]),
                     split)


def _number(value):
    """A CSV cell as JSON: '0.31' -> 0.31, '7' -> 7, '' -> None, other text as it is."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return value


def read_table(path: Path, images: Path | None, path_column: str, caption_column: str,
               split_column: str | None, splits: set[str] | None, where: Where | None = None,
               dropped: list[str] | None = None) -> Iterator[Record]:
    """CSV (header row) or JSONL; rows of one image are merged (first-appearance order).
    ``caption_column`` may name several columns, comma-separated (SkyScript: title,
    title_multi_objects); the row's other columns go to ``Record.meta`` (numbers as numbers) and
    ``where`` filters on them; the paths of filtered rows are appended to ``dropped``."""
    path = Path(path)
    root = images or path.parent
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"PAR1" or magic[:4] == b"ARRO" or path.suffix.lower() in (".parquet", ".arrow"):
        raise ValueError(f"{path} is a {'parquet' if magic == b'PAR1' or path.suffix == '.parquet' else 'arrow'} "
                         "file, not a CSV/TSV/JSONL table: pass it (or its folder) with --hf-dataset "
                         f"{path}, which reads parquet/arrow with the image bytes in a column")
    if path.suffix.lower() in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
    caption_columns = [c.strip() for c in caption_column.split(",") if c.strip()]
    for column in filter(None, (path_column, *caption_columns, split_column)):
        if rows and column not in rows[0]:
            raise ValueError(f"{path}: no column {column!r}; it has {sorted(rows[0])}. Name the columns "
                             "with --path-column / --caption-column (comma-separated for several) / --split-column")
    if where and rows:
        where.check_columns(rows[0], str(path))
    merged: dict[str, Record] = {}
    for row in rows:
        split = row.get(split_column) if split_column else None
        if splits and split not in splits:
            continue
        meta = {k: _number(v) for k, v in row.items() if k not in (path_column, *caption_columns)}
        if where and not where(meta):
            if dropped is not None:
                dropped.append(f"{row[path_column]}: {where.text}")
            continue
        name = str(row[path_column])
        rec = merged.setdefault(name, Record(root / name, [], split, meta))
        for column in caption_columns:
            rec.captions += _captions(row.get(column))
    yield from merged.values()


def read_folder(folder: Path) -> Iterator[Record]:
    """Images under ``folder`` (sorted) with the captions of the sidecar .txt of the same stem."""
    for path in sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in IMAGE_EXTS):
        txt = path.with_suffix(".txt")
        caps = _captions(txt.read_text(encoding="utf-8").splitlines()) if txt.is_file() else []
        yield Record(path, caps, None)


# --------------------------------------------------------------------------- images

@dataclass(frozen=True)
class Encoding:
    max_side: int = 0          # 0: keep the size
    format: str = "keep"       # keep | jpg | png | webp
    quality: int = 95
    bands: BandChoice | None = None   # multispectral TIFFs -> RGB (geotiff.py), written as PNG unless --format


def load_image(path: Path, enc: Encoding) -> tuple[bytes, str]:
    """-> (bytes, extension). Raises OSError/ValueError for unreadable files (decoded in full)."""
    data = path.read_bytes()
    ext = _EXT.get(path.suffix.lower().lstrip("."), path.suffix.lower().lstrip("."))
    if is_tiff(data) and (enc.bands is not None or _needs_bands(data)):
        out_ext = "png" if enc.format == "keep" else enc.format
        img = Image.fromarray(to_rgb(data, enc.bands, str(path)))   # BandsError without --bands
        if enc.max_side and max(img.size) > enc.max_side:
            scale = enc.max_side / max(img.size)
            img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                             Image.Resampling.LANCZOS)
        buf = io.BytesIO()
        img.save(buf, format=_PIL_FORMAT[out_ext], **({"quality": enc.quality} if out_ext != "png" else {}))
        return buf.getvalue(), out_ext
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        too_big = enc.max_side and max(img.size) > enc.max_side
        if not too_big and enc.format in ("keep", ext) and ext in _LOADER_EXTS:
            return data, ext
        # 'keep' re-encodes only what it must: resized images in their format (.tif as JPEG),
        # formats the loader does not look for (.bmp) losslessly as PNG
        out_ext = ({"tif": "jpg"}.get(ext, ext if ext in _PIL_FORMAT else "png")
                   if enc.format == "keep" else enc.format)
        img = img.convert("RGB") if img.mode not in ("RGB", "L") or out_ext == "jpg" else img
        if too_big:
            scale = enc.max_side / max(img.size)
            img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                             Image.Resampling.LANCZOS)
        buf = io.BytesIO()
        kw = {"quality": enc.quality} if out_ext in ("jpg", "webp") else {}
        img.save(buf, format=_PIL_FORMAT[out_ext], **kw)
        return buf.getvalue(), out_ext


def _needs_bands(data: bytes) -> bool:
    """A TIFF PIL would misread or refuse: more than 3 bands, or not 8-bit."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.mode.startswith(("I", "F"))
    except IMAGE_OPEN_ERRORS:
        return True


IMAGE_OPEN_ERRORS = (OSError, ValueError, SyntaxError)


def _prepare(args: tuple[Record, Encoding, bool]) -> tuple[str, object]:
    """Worker: ('ok', (bytes, ext, hashes)) or (kind, reason); ``hashes`` (near_duplicates.
    image_hashes of the bytes written) when the third argument says so, else None."""
    rec, enc, near_hash = args
    if not rec.captions:
        return "missing_caption", "no caption"
    if not rec.path.is_file():
        return "missing_image", "no such file"
    try:
        data, ext = load_image(rec.path, enc)
        return "ok", (data, ext, image_hashes(data) if near_hash else None)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) + HASH_ERRORS as err:
        return "unreadable_image", f"{type(err).__name__}: {err}"


def _key(rec: Record, root: Path | None, used: set[str]) -> str:
    """Sample key from the file name: no dots (webdataset splits at the first), unique."""
    try:
        rel = rec.path.relative_to(root) if root else Path(rec.path.name)
    except ValueError:
        rel = Path(rec.path.name)
    key = re.sub(r"[^A-Za-z0-9_\-]", "_", str(rel.with_suffix("")).replace("/", "__"))
    base, n = key, 1
    while key in used:
        key, n = f"{base}_{n}", n + 1
    used.add(key)
    return key


# --------------------------------------------------------------------------- writing

class _Shards:
    """Numbered tars that close at max_count samples or max_bytes payload bytes."""

    def __init__(self, out: Path, prefix: str, max_count: int, max_bytes: float):
        self.out, self.prefix, self.max_count, self.max_bytes = out, prefix, max_count, max_bytes
        self.writer, self.entries = None, []

    def write(self, sample: dict, size: int) -> None:
        cur = self.entries[-1] if self.entries else None
        if cur is None or cur["num_samples"] >= self.max_count or (self.max_bytes and cur["bytes"] >= self.max_bytes):
            self.close()
            name = f"{self.prefix}-{len(self.entries):06d}.tar"
            self.writer = TarWriter(str(self.out / name), encoder=False, mtime=_MTIME, user="", group="")
            self.entries.append({"url": name, "num_samples": 0, "bytes": 0})
            cur = self.entries[-1]
        self.writer.write(sample)
        cur["num_samples"] += 1
        cur["bytes"] += size

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _merge_index(out: Path, prefix: str, report: ShardReport, info: dict) -> dict:
    """index.json in ``out``: this prefix's shards replace its old ones, other splits stay."""
    path = out / "index.json"
    index = json.loads(path.read_text()) if path.is_file() else {}
    keep = [e for e in index.get("shards", []) if not e["url"].startswith(f"{prefix}-")]
    index["shards"] = sorted(keep + report.shards, key=lambda e: e["url"])
    index.setdefault("splits", {})[prefix] = info
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index


def make_shards(records: Iterator[Record] | list[Record], out: str | Path, *, prefix: str = "train",
                shard_size: int = 1000, shard_bytes: float = 0, encoding: Encoding = Encoding(),
                root: Path | None = None, workers: int = 1, progress: bool = True,
                console: Console | None = None, filtered: list[str] = (), exclude: NearIndex | None = None) -> dict:
    """Write shards of ``records`` into ``out``; returns this prefix's index entry with counts of
    skipped inputs (every skipped path is in ``{out}/{prefix}-report.json``); ``filtered``: the
    inputs a --where filter dropped before (counted as filtered_out). ``exclude`` (--exclude-near):
    images near one of these evaluation images are dropped (near_evaluation), every match listed
    in the report's ``near_evaluation_pairs``."""
    if shard_size < 1 or shard_bytes < 0:
        raise ValueError(f"--shard-size must be >= 1 and --shard-bytes >= 0 (got {shard_size}, {shard_bytes})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{prefix}-[0-9]*.tar"):
        old.unlink()   # a rerun with a larger shard size must not leave stale shards behind
    records = list(records)
    report, used, near_pairs = ShardReport(), set(), []
    for path in filtered:
        report.skip("filtered_out", path)
    shards = _Shards(out, prefix, shard_size, shard_bytes)
    columns = [TextColumn("make-shards {task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[skipped]} skipped"), TimeRemainingColumn()]
    pool = ProcessPoolExecutor(workers) if workers > 1 else None
    try:
        jobs = ((rec, encoding, exclude is not None) for rec in records)
        results = pool.map(_prepare, jobs, chunksize=16) if pool else map(_prepare, jobs)
        with Progress(*columns, console=console, disable=not progress) as bar:
            task = bar.add_task(prefix, total=len(records), skipped=0)
            for rec, (status, value) in zip(records, results):
                matches = exclude.pairs(np.uint64(value[2][0]), value[2][1])[0] if exclude and status == "ok" else []
                if matches:
                    report.skip("near_evaluation", f"{rec.path}: {matches[0]['set']} {matches[0]['image']}")
                    near_pairs += [{"input": str(rec.path), **m} for m in matches]
                elif status != "ok":
                    report.skip(status, f"{rec.path}: {value}")
                else:
                    data, ext, _ = value
                    meta = {**rec.meta, "filename": rec.path.name, "captions": rec.captions, "split": rec.split}
                    sample = {"__key__": _key(rec, root, used), ext: data,
                              "txt": "\n".join(rec.captions).encode("utf-8"),
                              "json": json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")}
                    shards.write(sample, sum(len(v) for k, v in sample.items() if k != "__key__"))
                    report.samples += 1
                bar.update(task, advance=1, skipped=sum(len(v) for v in report.skipped.values()))
    finally:
        shards.close()
        if pool:
            pool.shutdown()
    report.shards = shards.entries
    skipped = {k: len(v) for k, v in sorted(report.skipped.items())}
    info = {"num_samples": report.samples, "num_shards": len(report.shards), "skipped": skipped,
            "pattern": f"{prefix}-{{000000..{max(len(report.shards) - 1, 0):06d}}}.tar",
            "captions": sum(len(r.captions) for r in records)}
    near = {"exclude_near": exclude.fingerprint(), "near_evaluation_pairs": near_pairs} if exclude else {}
    (out / f"{prefix}-report.json").write_text(json.dumps(
        {**info, "skipped_paths": dict(sorted(report.skipped.items())), **near}, indent=2, sort_keys=True) + "\n")
    if report.samples == 0:
        raise ValueError(f"no usable input for {prefix!r}: skipped {skipped or 'nothing (no input)'}; "
                         f"see {out / f'{prefix}-report.json'} (check --images / the split / the columns)")
    _merge_index(out, prefix, report, info)
    return {**info, "shards": report.shards, "examples": {k: v[:5] for k, v in report.skipped.items()}}
