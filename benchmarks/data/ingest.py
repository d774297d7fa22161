"""make-shards --hf-dataset against a bare pyarrow + tarfile loop writing the same bytes.

    python -m benchmarks.data.ingest --out benchmarks/results/ingest.json          # ~1-2 min
    python -m benchmarks.data.ingest --tiny --out /tmp/ingest.json                  # seconds (a test)

A Git-10M-shaped parquet dataset (tests/corpora.py's columns and types, 256 px JPEGs) is written
once; then, in alternation, the bare loop (pyarrow iter_batches -> the same three members per row
-> tarfile, one process) and ``convert`` (datasets streaming, header check, progress file,
atomic shards) with 1 and 2 workers. The outputs are compared byte for byte first (the ratio
compares equal work). Per core = rows/s / processes used (capped at the cores available);
ratio = ours per core / bare per core (target >= 0.9). The Git-10M projection is 10.5M rows /
(per-core rate x 32 cores): a lower bound on the time, because one process reads the parquet and writes
every tar (workers only check and re-encode), so past some core count that process and the disk
bound it; the JSON says so.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.harness import base_parser, environment, write_report

GIT10M_ROWS = 10_500_000


def bare_loop(files: list[str], out: Path, shard_size: int) -> int:
    """What a user would write: pyarrow batches -> tar members, no checks, no resume."""
    import pyarrow.parquet as pq

    from rsclip_ds.data.hf_source import tile_centre

    out.mkdir(parents=True, exist_ok=True)
    row, tar, in_shard, shard = 0, None, 0, 0
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=256):
            cols = batch.to_pydict()
            for i in range(batch.num_rows):
                r = {k: v[i] for k, v in cols.items()}
                meta = {k: v for k, v in r.items() if k != "image"}
                meta["latitude"], meta["longitude"] = tile_centre(r["Google_location"])
                info = {**meta, "filename": r["img_name"], "captions": [r["caption"]], "split": "train"}
                members = {"jpg": r["image"]["bytes"], "txt": r["caption"].encode(),
                           "json": json.dumps(info, sort_keys=True, ensure_ascii=False).encode()}
                if tar is None:
                    tar = tarfile.open(out / f"train-{shard:06d}.tar", "w", format=tarfile.USTAR_FORMAT)
                for ext, data in members.items():
                    ti = tarfile.TarInfo(f"{row:09d}.{ext}")
                    ti.size, ti.mtime, ti.mode = len(data), 946684800, 0o444
                    tar.addfile(ti, io.BytesIO(data))
                row, in_shard = row + 1, in_shard + 1
                if in_shard == shard_size:
                    tar.close()
                    tar, in_shard, shard = None, 0, shard + 1
    if tar is not None:
        tar.close()
    return row


def _ours(folder: Path, out: Path, shard_size: int, workers: int) -> int:
    from rsclip_ds.data.convert import convert
    from rsclip_ds.data.hf_source import resolve_hf_dataset

    info = convert(resolve_hf_dataset(str(folder)), out, shard_size=shard_size, workers=workers, progress=False)
    return info["num_samples"]


def _tars(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("train-*.tar"))}


def main(argv=None) -> int:
    parser = base_parser(__doc__, tiny=True, out=Path("benchmarks/results/ingest.json"))
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows, repeats = (240, 1) if args.tiny else (args.rows, args.repeats)
    from tests.corpora import git10m_dataset, git10m_rows, jpeg

    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="ingest-bench-"))
    try:
        folder = work / "git10m"
        (folder / "data").mkdir(parents=True)
        table = git10m_rows(rows)   # without its planted faults: both sides must write every row
        table["image"] = [{"bytes": jpeg(i, 256), "path": None} for i in range(rows)]
        table["caption"] = [c or "a road between fields" for c in table["caption"]]
        ds = git10m_dataset(rows, table)
        for k in range(2):
            ds.shard(2, k, contiguous=True).to_parquet(str(folder / "data" / f"train-{k:05d}-of-00002.parquet"))
        files = sorted(str(p) for p in (folder / "data").glob("*.parquet"))
        shard_size = max(10, rows // 8)
        seconds = {"bare": [], "workers_1": [], "workers_2": []}
        for rep in range(repeats):
            for name in seconds:
                out = work / f"{name}-{rep}"
                t0 = time.perf_counter()
                n = bare_loop(files, out, shard_size) if name == "bare" else \
                    _ours(folder, out, shard_size, int(name[-1]))
                seconds[name].append(time.perf_counter() - t0)
                assert n == rows, (name, n)
            same = _tars(work / f"bare-{rep}") == _tars(work / f"workers_1-{rep}") == _tars(work / f"workers_2-{rep}")
            assert same, "the bare loop and make-shards wrote different bytes: the ratio would compare unequal work"
        procs = {"bare": 1, "workers_1": 1, "workers_2": 3}
        results = {}
        for name, ts in seconds.items():
            rate = rows / min(ts)
            results[name] = {"rows_per_s": round(rate, 1), "processes": procs[name],
                             "per_core": round(rate / min(procs[name], cores), 1), "seconds": [round(t, 3) for t in ts]}
        bare = results["bare"]["per_core"]
        for name in ("workers_1", "workers_2"):
            results[name]["ratio_to_bare"] = round(results[name]["per_core"] / bare, 3)
        best = max(results["workers_1"]["per_core"], results["workers_2"]["per_core"])
        report = {"benchmark": "ingest", "tiny": args.tiny, "rows": rows, "repeats": repeats,
                  "shard_size": shard_size, "bytes_identical": True, "results": results,
                  "git10m_projection": {"rows": GIT10M_ROWS, "cores": 32,
                                        "hours": round(GIT10M_ROWS / (best * 32) / 3600, 2),
                                        "note": "a lower bound on the time: one process reads and writes every tar"},
                  "environment": environment(1, cores_available=cores)}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def tables(r: dict) -> None:
        for name, row in r["results"].items():
            print(f"{name:10s} {row['rows_per_s']:9.1f} rows/s  {row['per_core']:9.1f} /core  "
                  f"ratio {row.get('ratio_to_bare', 1.0):.3f}")
        print(f"Git-10M on 32 cores: ~{r['git10m_projection']['hours']} h")

    write_report(report, args.out, tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
