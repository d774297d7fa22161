"""Train/test leakage: training shards against evaluation images, by perceptual hash.

    evaluation_images(source)  -> the images of a suite root or a caption JSON, each with its set
    build_near_index(...)      -> their hashes in an index (data/near_duplicates.py), unreadable ones listed
    cross_set_pairs(near)      -> images shared by two evaluation sets (RSICD and RSITMD share some)
    check_shards(urls, near)   -> every training image matched against the index

``rsclip-ds check-leakage`` (cli/leakage.py) writes the report; ``make-shards --exclude-near``
(cli/data.py) drops the matches while it writes shards. Decoding and hashing are the cost
(~1 ms a 256 px JPEG): both run in ``workers`` processes, the index query too (each worker
holds a copy of the evaluation index, set up once by the pool's initializer), so the main
process only gathers results.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rsclip_ds.config import ConfigError, DataConfig
from rsclip_ds.data.bad import StreamCounter
from rsclip_ds.data.near_duplicates import FINE_WORDS, HASH_ERRORS, HashIndex, NearIndex, image_hashes
from rsclip_ds.data.tar import read_shard
from rsclip_ds.evaluation.datasets import IMAGE_EXTENSIONS, _images_folder

EXAMPLES = 20     # unreadable images listed per source in the report
DEFAULT_IMAGE_KEYS = DataConfig.model_fields["image_key"].default


@dataclass(frozen=True)
class EvalImage:
    set: str                # the evaluation set it belongs to
    path: Path
    split: str | None = None   # a caption JSON's split of the image


def _named_sets(root: Path) -> list[tuple[Path, str]]:
    """(folder, name) of every set the catalog recognises under a suite root, deepest first, so an
    image is counted under the standard set's name whatever its folder is called."""
    from rsclip_ds.evaluation.catalog import find_sets

    found, _ = find_sets(root)
    known = [(f.root.resolve(), f.name) for f in found if f.spec is not None]   # unknown sets: by folder
    return sorted(known, key=lambda named: -len(named[0].parts))


def _set_of(path: Path, root: Path, named: list[tuple[Path, str]]) -> str:
    """The set of an image under a suite root: the recognised set whose folder holds it (all of its
    images, not only the test split: a training copy of any of them is a leak), else the image's
    top-level folder."""
    parents = path.resolve().parents
    for folder, name in named:
        if folder in parents:
            return name
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else root.name


def evaluation_images(source: str | Path) -> list[EvalImage]:
    """A suite root (a folder of evaluation sets: every image file under it, its set the one
    catalog.find_sets recognises there, else the top-level folder) or a Karpathy caption JSON (its images, all splits; its set the JSON's
    "dataset" name, else the file name)."""
    source = Path(source)
    if source.is_dir():
        found = sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not found:
            raise ConfigError(f"--against {source}: no image files under it ({', '.join(IMAGE_EXTENSIONS)})")
        named = _named_sets(source)
        return [EvalImage(_set_of(p, source, named), p) for p in found]
    if source.is_file() and source.suffix.lower() == ".json":
        return _caption_json_images(source)
    raise ConfigError(f"--against {source}: {'not a .json file' if source.is_file() else 'no such file or folder'}; "
                      "give a suite root (a folder with one folder per evaluation set) or a Karpathy caption "
                      "JSON (dataset_rsicd.json, with its images folder beside it)")


def _caption_json_images(path: Path) -> list[EvalImage]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"--against {path}: not a JSON file ({err})") from None
    entries = data.get("images") if isinstance(data, dict) else None
    if not entries:
        raise ConfigError(f"--against {path}: no 'images' list; a Karpathy caption JSON looks like "
                          '{"images": [{"filename": ..., "split": ..., "sentences": [...]}]}')
    name = str(data.get("dataset") or path.stem)
    first = entries[0].get("filepath", "")
    folder = _images_folder(path, str(Path(first) / entries[0]["filename"]), None)
    return [EvalImage(name, folder / e.get("filepath", "") / e["filename"], e.get("split")) for e in entries]


# --------------------------------------------------------------------------- hashing files

def _hash_file(path: Path) -> tuple[int, np.ndarray] | str:
    try:
        return image_hashes(Path(path).read_bytes())
    except HASH_ERRORS as err:
        return f"{type(err).__name__}: {err}"


def _progress(console: Console | None, enabled: bool, unit: str) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[images]:,} images, {task.fields[rate]:,.0f} images/s"),
                    TimeElapsedColumn(), console=console, disable=not enabled)


def hash_files(paths: list[Path], workers: int, console: Console | None = None, progress: bool = True,
               label: str = "hashing") -> tuple[np.ndarray, np.ndarray, list[int], list[str]]:
    """-> (coarse (n,), fine (n, 4), the indices of the readable paths, 'path: why' per unreadable one)."""
    pool = ProcessPoolExecutor(workers) if workers > 1 else None
    coarse, fine, ok, bad = [], [], [], []
    t0 = time.perf_counter()
    try:
        results = pool.map(_hash_file, paths, chunksize=32) if pool else map(_hash_file, paths)
        with _progress(console, progress, "images") as bar:
            task = bar.add_task(label, total=len(paths), images=0, rate=0.0)
            for i, result in enumerate(results):
                if isinstance(result, str):
                    bad.append(f"{paths[i]}: {result}")
                else:
                    coarse.append(result[0])
                    fine.append(result[1])
                    ok.append(i)
                if i % 64 == 63 or i + 1 == len(paths):
                    bar.update(task, completed=i + 1, images=i + 1, rate=(i + 1) / max(time.perf_counter() - t0, 1e-9))
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return (np.array(coarse, np.uint64), np.array(fine, np.uint64).reshape(-1, FINE_WORDS), ok, bad)


@dataclass
class EvalIndex:
    """The evaluation side: the index, images per set, what could not be read."""
    near: NearIndex
    images_per_set: dict[str, int]
    unreadable: list[str]


def build_near_index(sources: list[str | Path], *, workers: int, max_distance: int, max_fine_distance: int,
                     console: Console | None = None, progress: bool = True) -> EvalIndex:
    """Hash every evaluation image of ``sources`` (suite roots / caption JSONs) into a NearIndex."""
    images = [img for source in sources for img in evaluation_images(source)]
    coarse, fine, ok, bad = hash_files([img.path for img in images], workers, console, progress,
                                       "hashing evaluation images")
    if not ok:
        raise ConfigError(f"--against {', '.join(map(str, sources))}: none of the {len(images)} images could be "
                          f"read, e.g. {bad[0]}")
    kept = [images[i] for i in ok]
    per_set: dict[str, int] = {}
    for img in kept:
        per_set[img.set] = per_set.get(img.set, 0) + 1
    index = HashIndex(coarse, fine, max_distance, max_fine_distance)
    near = NearIndex(index, [img.set for img in kept], [str(img.path) for img in kept], [str(s) for s in sources])
    return EvalIndex(near, dict(sorted(per_set.items())), bad)


def cross_set_pairs(near: NearIndex) -> list[dict]:
    """Pairs of evaluation images of two different sets within the distances (each pair once)."""
    found = near.index.query(near.index.coarse, near.index.fine)
    out = []
    for i, j, d, f in zip(found.query.tolist(), found.index.tolist(), found.distance.tolist(), found.fine.tolist()):
        if i < j and near.sets[i] != near.sets[j]:
            out.append({"set_a": near.sets[i], "image_a": near.paths[i], "set_b": near.sets[j],
                        "image_b": near.paths[j], "distance": d, "fine_distance": f})
    return out


# --------------------------------------------------------------------------- the training shards

@dataclass
class ShardResult:
    url: str
    images: int = 0
    pairs: list[dict] = field(default_factory=list)       # {"shard", "key", "set", "image", ...}
    unreadable: list[str] = field(default_factory=list)   # "shard key: why"
    bad: dict[str, int] = field(default_factory=dict)     # shard-level problems (tar.py kinds)


def check_shard(url: str, near: NearIndex, image_keys: tuple[str, ...]) -> ShardResult:
    """Hash every image of one shard and match it against ``near``."""
    counter = StreamCounter({})
    result, keys, coarse, fine = ShardResult(url), [], [], []
    for sample in read_shard(url, counter):
        ext = next((k for k in image_keys if k in sample), None)
        if ext is None:
            result.unreadable.append(f"{sample['__key__']}: no image member ({'/'.join(image_keys)})")
            continue
        try:
            c, f = image_hashes(sample[ext])
        except HASH_ERRORS as err:
            result.unreadable.append(f"{sample['__key__']}: {type(err).__name__}: {err}")
            continue
        keys.append(sample["__key__"])
        coarse.append(c)
        fine.append(f)
    result.images = len(keys)
    if keys:
        for key, matches in zip(keys, near.pairs(np.array(coarse, np.uint64), np.array(fine, np.uint64))):
            result.pairs += [{"shard": url, "key": key, **m} for m in matches]
    result.bad = {k: v for k, v in counter.bad.items() if v}
    return result


_WORKER_NEAR: NearIndex | None = None    # a pool worker's copy of the index (_init_worker)


def _init_worker(near: NearIndex) -> None:
    global _WORKER_NEAR
    _WORKER_NEAR = near


def _check_in_worker(args: tuple[str, tuple[str, ...]]) -> ShardResult:
    return check_shard(args[0], _WORKER_NEAR, args[1])


def check_shards(urls: list[str], near: NearIndex, *, workers: int, image_keys: tuple[str, ...],
                 console: Console | None = None, progress: bool = True) -> list[ShardResult]:
    """check_shard over ``urls`` in ``workers`` processes; results in shard order."""
    pool = (ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(near,))
            if workers > 1 and len(urls) > 1 else None)
    out, images, t0 = [], 0, time.perf_counter()
    try:
        jobs = [(url, image_keys) for url in urls]
        results = pool.map(_check_in_worker, jobs) if pool else (check_shard(u, near, image_keys) for u in urls)
        with _progress(console, progress, "images") as bar:
            task = bar.add_task("hashing training shards", total=len(urls), images=0, rate=0.0)
            for result in results:
                out.append(result)
                images += result.images
                bar.update(task, advance=1, images=images, rate=images / max(time.perf_counter() - t0, 1e-9))
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return out


def leakage_report(evals: EvalIndex, cross: list[dict], shards: list[ShardResult], seconds: dict[str, float]) -> dict:
    """The JSON report: every matched pair, counts per evaluation set, what could not be read.
    ``seconds``: {"evaluation": hashing the evaluation images, "training": checking the shards}."""
    from rsclip_ds.data.near_duplicates import hash_version

    near = evals.near
    pairs = [p for r in shards for p in r.pairs]
    counts = {name: {"images": n, "matched_images": 0, "training_images": 0, "pairs": 0}
              for name, n in evals.images_per_set.items()}
    for name in counts:
        mine = [p for p in pairs if p["set"] == name]
        counts[name].update(pairs=len(mine), matched_images=len({p["image"] for p in mine}),
                            training_images=len({(p["shard"], p["key"]) for p in mine}))
    cross_counts: dict[str, int] = {}
    for p in cross:
        label = " ~ ".join(sorted((p["set_a"], p["set_b"])))
        cross_counts[label] = cross_counts.get(label, 0) + 1
    bad_shards: dict[str, int] = {}
    for r in shards:
        for kind, n in r.bad.items():
            bad_shards[kind] = bad_shards.get(kind, 0) + n
    images = sum(r.images for r in shards)
    unreadable = [f"{r.url} {u}" for r in shards for u in r.unreadable]
    return {
        "hash": hash_version(), "max_distance": near.index.max_distance,
        "max_fine_distance": near.index.max_fine_distance, "against": near.sources,
        "shards": len(shards), "training_images": images,
        "training_pairs": len(pairs), "training_images_matched": len({(p["shard"], p["key"]) for p in pairs}),
        "evaluation_images": len(near.paths), "counts": counts, "pairs": pairs,
        "cross_set": {"counts": dict(sorted(cross_counts.items())), "pairs": cross},
        "unreadable": {"training": len(unreadable), "training_examples": unreadable[:EXAMPLES],
                       "evaluation": len(evals.unreadable), "evaluation_examples": evals.unreadable[:EXAMPLES],
                       "shards": bad_shards},
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "training_images_per_second": round(images / max(seconds["training"], 1e-9), 1),
    }
