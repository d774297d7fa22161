"""The conversion loop of ``make-shards --hf-dataset``: rows -> shards, progress, resume, report.

ingest.py says what a row becomes and how shards are written atomically; this module runs it:
source rows in chunks through the workers (in order), shards closed and vouched for by the
progress file, a rich progress bar with rows/s and ETA, and at the end the report and index.json.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

from rsclip_ds.data.hf_source import HFSource
from rsclip_ds.data.ingest import _TEXT_CAP, AtomicShards, Progress, RowSpec, _ordered, split_images
from rsclip_ds.data.near_duplicates import NearIndex
from rsclip_ds.data.shard_writer import _merge_index

FORMAT_VERSION = 2   # of the progress file and of what a row becomes; a change refuses old progress
                     # (2: float32 columns in their shortest form)


def _fingerprint(source: HFSource, spec: RowSpec, shard_size: int, shard_bytes: float,
                 exclude: NearIndex | None) -> dict:
    spec_d = asdict(spec)
    out = {"version": FORMAT_VERSION, "source": source.fingerprint(), "spec": json.loads(json.dumps(spec_d)),
           "shard_size": shard_size, "shard_bytes": shard_bytes}
    if exclude is not None:   # the same evaluation images and distances, or no resume
        out["exclude_near"] = exclude.fingerprint()
    return out


def _near_rows(results: list[tuple[str, object]], exclude: NearIndex | None) -> dict[int, list[dict]]:
    """--exclude-near: the chunk's rows (by position) whose image matches evaluation images -> the
    matches; one batched index query per chunk."""
    if exclude is None:
        return {}
    at = [i for i, (status, _) in enumerate(results) if status == "ok"]
    if not at:
        return {}
    hashes = [results[i][1][-1] for i in at]
    found = exclude.pairs(np.array([h[0] for h in hashes], np.uint64), np.stack([h[1] for h in hashes]))
    return {i: [{"img_name": h[2], **m} for m in matches] for i, h, matches in zip(at, hashes, found) if matches}


def _clean(out: Path, prefix: str, keep: set[str]) -> None:
    """Delete this prefix's tars that no progress file vouches for, and every partial one."""
    for path in list(out.glob(f"{prefix}-[0-9]*.tar")) + list(out.glob(f"{prefix}-[0-9]*.tar.partial")):
        if path.name not in keep:
            path.unlink()


def start_state(out: Path, prefix: str, fingerprint: dict, restart: bool) -> Progress:
    """The saved progress of an interrupted conversion with the same options, or a fresh one."""
    path = out / f"{prefix}-progress.json"
    state = None
    if path.is_file() and not restart:
        saved = json.loads(path.read_text())
        if saved.get("fingerprint") != fingerprint and saved.get("shards"):
            changed = sorted(k for k in set(fingerprint) | set(saved.get("fingerprint", {}))
                             if fingerprint.get(k) != saved.get("fingerprint", {}).get(k))
            raise ValueError(f"{path}: an interrupted conversion into {out} with other options or input "
                             f"(differs in: {', '.join(changed)}). Rerun it with the same command to resume, "
                             "or pass --restart to discard it and start over")
        state = Progress(**saved) if saved.get("fingerprint") == fingerprint else None   # nothing done yet
    state = state or Progress(fingerprint)
    _clean(out, prefix, {e["url"] for e in state.shards})
    state.save(path)
    return state


def _chunks(source: HFSource, spec: RowSpec, start: int, rows: int) -> Iterator[tuple[tuple, list]]:
    """(what a worker gets, the image bytes the main process keeps) per chunk of ``rows`` rows."""
    at = start
    for batch in source.iter_batches(start, rows, spec.image_column):
        n = len(next(iter(batch.values()))) if batch else 0
        yield split_images(at, batch, spec)
        at += n


def convert(source: HFSource, out: str | Path, *, prefix: str = "train", spec: RowSpec = RowSpec(),
            shard_size: int = 1000, shard_bytes: float = 0, workers: int = 1, chunk_rows: int = 256,
            restart: bool = False, progress: bool = True, console: Console | None = None,
            on_row: Callable[[int], None] | None = None, exclude: NearIndex | None = None) -> dict:
    """Convert ``source`` into shards in ``out`` (resuming an interrupted run with the same
    options unless ``restart``); returns this prefix's index entry with the skip counts and
    examples. ``on_row(i)`` is called after row i is handled (the tests kill a run from it).
    ``exclude``: rows whose image is near one of these evaluation images are dropped
    (``near_evaluation``; every match in the report's ``near_evaluation_pairs``)."""
    if shard_size < 1 or shard_bytes < 0 or workers < 1:
        raise ValueError(f"--shard-size and --workers must be >= 1, --shard-bytes >= 0 (got {shard_size}, "
                         f"{workers}, {shard_bytes})")
    spec.check(source.columns, f"--hf-dataset {source.label}")
    spec = replace(spec, float32_columns=source.float32_columns, near_hash=exclude is not None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{prefix}-progress.json"
    state = start_state(out, prefix, _fingerprint(source, spec, shard_size, shard_bytes, exclude), restart)
    resumed_at = state.rows_done
    shards = AtomicShards(out, prefix, shard_size, shard_bytes, start=len(state.shards))

    pool = ProcessPoolExecutor(workers) if workers > 1 else None
    columns = [TextColumn("make-shards {task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]:,.0f} rows/s"), TextColumn("{task.fields[skipped]} skipped"),
               TimeRemainingColumn()]
    t0, row = time.perf_counter(), resumed_at - 1
    try:
        with Bar(*columns, console=console, disable=not progress) as bar:
            task = bar.add_task(prefix + (f" (resumed at row {resumed_at:,})" if resumed_at else ""),
                                total=source.total, completed=resumed_at, rate=0.0, skipped=sum(state.skipped.values()))
            chunks = _chunks(source, spec, resumed_at, chunk_rows)
            for (results, stats), images in _ordered(chunks, pool, window=4 * workers):
                state.merge(stats)   # (with --exclude-near the column ranges count the rows dropped below too)
                near = _near_rows(results, exclude)
                for at, ((status, value), kept) in enumerate(zip(results, images)):
                    row += 1
                    if at in near:
                        state.skip("near_evaluation", f"row {row}: {near[at][0]['set']} {near[at][0]['image']}")
                        state.near_pairs += [{"row": row, **m} for m in near[at]]
                    elif status == "ok":
                        head, image, tail, captions, text_bytes, _ = value
                        image = kept if image is None else image   # checked here: its bytes stayed here
                        state.samples += 1
                        state.captions += captions
                        closed = shards.write((head, image, tail), len(image) + text_bytes)
                        if closed:
                            state.shards.append(closed)
                            state.rows_done = row + 1
                            state.save(path)   # after the rename: the shard is vouched for
                    else:
                        state.skip(status, f"row {row}: {value}")
                    if on_row:
                        on_row(row)
                done = row + 1 - resumed_at
                bar.update(task, completed=row + 1, rate=done / max(time.perf_counter() - t0, 1e-9),
                           skipped=sum(state.skipped.values()))
        closed = shards.close()
    finally:
        if shards.tar is not None:   # an error mid-shard: leave only complete shards behind
            shards.tar.close()
            (out / (shards.entry["url"] + ".partial")).unlink(missing_ok=True)
        if pool:
            pool.shutdown(cancel_futures=True)
    if closed:
        state.shards.append(closed)
    state.rows_done = source.total
    return _finish(out, prefix, source, state, path, resumed_at, time.perf_counter() - t0)


def _finish(out: Path, prefix: str, source: HFSource, state: Progress, path: Path, resumed_at: int,
            seconds: float) -> dict:
    skipped = {k: state.skipped[k] for k in sorted(state.skipped)}
    columns = {}
    for name, col in sorted(state.columns.items()):
        col = dict(col)
        distinct = col.pop("_distinct", None)
        if distinct is not None:
            col["distinct"] = len(distinct) if len(distinct) <= _TEXT_CAP else f">{_TEXT_CAP}"
        columns[name] = col
    info = {"num_samples": state.samples, "num_shards": len(state.shards), "skipped": skipped,
            "pattern": f"{prefix}-{{000000..{max(len(state.shards) - 1, 0):06d}}}.tar", "captions": state.captions,
            "rows": source.total, "source": {"hf_dataset": source.label, **source.fingerprint()},
            "columns": columns, "where": state.fingerprint["spec"]["where"] or None}
    report = {**info, "skipped_examples": state.examples, "resumed_at_row": resumed_at,
              "seconds_this_run": round(seconds, 3)}
    if "exclude_near" in state.fingerprint:
        report.update(exclude_near=state.fingerprint["exclude_near"], near_evaluation_pairs=state.near_pairs)
    (out / f"{prefix}-report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    if state.samples == 0:
        raise ValueError(f"no usable row for {prefix!r} out of {source.total}: skipped {skipped or 'nothing'}; "
                         f"see {out / f'{prefix}-report.json'} (check --where, --caption-column, --image-column)")
    _merge_index(out, prefix, SimpleNamespace(shards=state.shards), info)
    path.unlink(missing_ok=True)   # complete: a rerun starts over
    return {**info, "shards": state.shards, "examples": {k: v[:5] for k, v in state.examples.items()}}
