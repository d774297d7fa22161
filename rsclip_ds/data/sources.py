"""Shard specs -> shard urls, and how many samples each shard holds.

``data.train_shards`` is one or more sources joined by '::'; each is a brace pattern, a glob, a
.txt list (one url per line) or a url (local path, ``pipe:aws s3 cp s3://bucket/x.tar -``,
http(s)://, gs://). Sample counts per shard come from an index JSON (make-shards,
make-synthetic), img2dataset ``*_stats.json`` or counting a local tar's headers; in a multi-rank
run global rank 0 alone reads them and broadcasts them (shard_counts_from_rank0).
"""

from __future__ import annotations

import glob
import json
import logging
import tarfile
import time
from pathlib import Path
from typing import Sequence

import braceexpand

from rsclip_ds.data.tar import split_member

log = logging.getLogger("rsclip_ds.data")
_REMOTE_PREFIXES = ("pipe:", "http://", "https://", "gs://", "hf://", "ais://")


def _read_list(path: Path) -> list[str]:
    """A shard list: one url per line, '#' comments; relative paths are relative to the list."""
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return [ln if ln.startswith(_REMOTE_PREFIXES + ("file:",)) or Path(ln).is_absolute()
            else str(path.parent / ln) for ln in lines if ln]


def _expand_one(item: str, spec: str) -> list[str]:
    """One brace-expanded entry -> urls (glob, list file, remote url or existing local file)."""
    if item.startswith(_REMOTE_PREFIXES + ("file:",)):   # 'file:' opts out of the existence check
        return [item]
    local = item
    if any(c in local for c in "*?["):
        found = sorted(glob.glob(local))
    elif not Path(local).is_file():
        found = []
    elif local.endswith(".txt"):
        found = [url for line in _read_list(Path(local)) for url in _expand_one(line, spec)]
    else:
        found = [item]
    if not found:
        raise ValueError(f"data.train_shards {spec!r}: {item!r} matches no file; check the path "
                         "(a brace pattern, a glob, a .txt shard list or a pipe:/http(s): url)")
    return found


def expand_sources(spec: str) -> list[list[str]]:
    """'a-{000..009}.tar::more/*.tar' -> one url list per '::'-separated source."""
    sources = [[url for item in braceexpand.braceexpand(part.strip()) for url in _expand_one(item, spec)]
               for part in spec.split("::") if part.strip()]
    if not sources:
        raise ValueError(f"data.train_shards {spec!r} names no shards")
    return sources


def expand_urls(spec: str) -> list[str]:
    """'a-{000..009}.tar::more/*.tar::list.txt::pipe:cat x.tar' -> list of shard urls, in order."""
    return [url for source in expand_sources(spec) for url in source]


def _local(url: str) -> Path | None:
    return None if url.startswith(_REMOTE_PREFIXES) else Path(url.removeprefix("file:"))


def _index_entries(path: Path) -> dict[str, int]:
    """{shard file name: num_samples} from any [{"url", "num_samples"}] list in an index JSON."""
    data = json.loads(path.read_text())
    lists = [v for v in (data.values() if isinstance(data, dict) else [data]) if isinstance(v, list)]
    return {Path(e["url"]).name: int(e["num_samples"]) for lst in lists for e in lst
            if isinstance(e, dict) and "url" in e and "num_samples" in e}


def count_tar_samples(path: Path) -> int:
    """Distinct sample keys in a local tar (seeks over member data: headers only); a broken tar
    counts what precedes the break (reading it reports the break)."""
    keys = set()
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if member.isfile():
                    keys.add(split_member(member.name)[0])
    except (tarfile.TarError, EOFError, OSError):
        pass
    return len(keys)


def shard_counts(urls: Sequence[str], shard_index: str | None = None) -> dict[str, int]:
    """{url: samples}; from shard_index JSON(s), index.json beside a shard, img2dataset's
    <shard>_stats.json, or by counting a local tar (a missing file counts 0: it is reported as
    missing_shard when read)."""
    named: dict[str, int] = {}
    for part in (shard_index or "").split("::"):
        if part.strip():
            named.update(_index_entries(Path(part.strip())))
    beside: dict[Path, dict[str, int]] = {}
    counts = {}
    for url in urls:
        name = url.rstrip("/").rsplit("/", 1)[-1].split(" ")[-1]
        local = _local(url)
        if name in named:
            counts[url] = named[name]
            continue
        if local is None:
            raise ValueError(f"no sample count for {url!r}: name an index JSON in data.shard_index "
                             "(make-shards writes one), or use data.policy=resampled with "
                             "data.epoch_batches")
        if local.parent not in beside:
            idx = local.parent / "index.json"
            beside[local.parent] = _index_entries(idx) if idx.is_file() else {}
        stats = local.with_name(local.stem + "_stats.json")
        if local.name in beside[local.parent]:
            counts[url] = beside[local.parent][local.name]
        elif stats.is_file():
            counts[url] = int(json.loads(stats.read_text())["successes"])
        elif local.is_file():
            counts[url] = count_tar_samples(local)
        else:
            counts[url] = 0
    return counts


def shard_counts_from_rank0(urls: Sequence[str], shard_index: str | None = None, *,
                            read=shard_counts) -> dict[str, int]:
    """``read(urls, shard_index)`` (shard_counts) on global rank 0 alone, broadcast to the other
    ranks of the default process group: without an index JSON every rank would read every tar's
    headers at start-up (ranks x shards metadata requests on a shared file system; 512 ranks x
    10,000 shards is 5 million). Rank 0's failure (a url without a count) is raised on every rank
    with its message; a rank whose shard list differs from rank 0's raises too."""
    import torch.distributed as dist

    box: list = [None]
    if dist.get_rank() == 0:
        t0 = time.perf_counter()
        try:
            box = [("counts", read(urls, shard_index))]
        except ValueError as err:
            box = [("error", str(err))]
        else:
            log.info("shard sample counts: %d shards, %d samples, read by rank 0 for all %d ranks in %.1f s",
                     len(box[0][1]), sum(box[0][1].values()), dist.get_world_size(), time.perf_counter() - t0)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise ValueError(value)
    if set(value) != set(urls):
        raise ValueError(f"rank {dist.get_rank()} expands data.train_shards to other shards than rank 0 "
                         f"({len(urls)} here, {len(value)} there, e.g. "
                         f"{sorted(set(urls) ^ set(value))[:3]}): do all nodes see the same files?")
    return value
