"""make-shards --hf-dataset against a bare pyarrow + tarfile loop writing the same bytes.

    python -m benchmarks.data.ingest --out benchmarks/results/ingest.json          # ~3 min on 2 cores
    python -m benchmarks.data.ingest --tiny --out /tmp/ingest.json                  # seconds (a test)

A Git-10M-shaped parquet dataset (tests/corpora.py's columns and types, 256 px JPEGs of ~45 KB,
files of 1,500 rows as the hub splits a dataset) is written once. Then, in alternation, each
variant runs in a fresh process, as a user runs it: the bare loop (pyarrow iter_batches -> the
same three members per row -> tarfile, one process), and `rsclip-ds make-shards --hf-dataset`
(through the CLI's main: datasets streaming, header check, progress file, atomic shards) with 1
and 2 workers. The outputs are compared by hash first (the ratio compares equal work).

Per core = rows per CPU-second of every process involved: user + system time of the variant's
process and of its (joined) worker processes, from getrusage around the conversion alone
(interpreter start-up and imports excluded for all variants alike), as benchmarks/data/loader.py
measures per CPU-second. Ratio = ours / bare per CPU-second, paired per repeat, median over
repeats (target >= 0.9). Each variant also converts a 256-row dataset: its CPU is mostly start-up
(first-use imports inside datasets, resolving the dataset's files: about a second), which the
whole-run rate at --rows carries and 10.5M rows do not; the steady rate (N - 256) / (CPU_N -
CPU_256) and its ratio are reported beside. Imports are made before the clock starts on both
sides (the datasets library's own first-use imports inside a conversion are part of its start-up). The --tiny form measures in this process (a shape
check, not a number).

The Git-10M projection on 32 cores, at the steady rates: the conversion is bounded by the slower
of 32 cores at the 2-worker rate per CPU-second and its one main process (reads the parquet,
checks the headers, writes every tar), whose own CPU per row is measured in the 2-worker run;
the disk is assumed to keep up.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.harness import base_parser, environment, write_report

GIT10M_ROWS = 10_500_000
ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("bare", "workers_1", "workers_2")
TARGET = 0.9


def bare_loop(files: list[str], out: Path, shard_size: int) -> int:
    """What a user would write: pyarrow batches -> tar members, no checks, no resume."""
    import numpy as np
    import pyarrow.parquet as pq

    import pyarrow as pa

    from rsclip_ds.data.hf_source import tile_centre

    out.mkdir(parents=True, exist_ok=True)
    row, tar, in_shard, shard = 0, None, 0, 0
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=256):
            cols = batch.to_pydict()
            for name in (fl.name for fl in batch.schema if fl.type == pa.float32()):   # 0.98, not 0.98000001907
                cols[name] = [float(str(np.float32(x))) for x in cols[name]]
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


def _cpu() -> tuple[float, float, int]:
    """(this process, its terminated and joined children): user + system seconds; this
    process's minor page faults."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, me.ru_minflt


def run_variant(variant: str, folder: Path, out: Path, shard_size: int) -> dict:
    """One conversion in this process -> rows, wall and CPU seconds (this process and its workers)."""
    files = sorted(str(p) for p in (folder / "data").glob("*.parquet"))
    # what each side imports, imported before the clock starts (the bare loop's tile_centre comes
    # with rsclip_ds.data, whose package imports torch: a second of CPU that is no part of a loop)
    import numpy  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    import rsclip_ds.data.hf_source  # noqa: F401
    if variant != "bare":
        import datasets  # noqa: F401

        import rsclip_ds.data.convert  # noqa: F401
        from rsclip_ds.cli import main as cli
    t0, (m0, c0, f0) = time.perf_counter(), _cpu()
    if variant == "bare":
        rows = bare_loop(files, out, shard_size)
    else:
        argv = ["make-shards", "--hf-dataset", str(folder), "--out", str(out), "--shard-size", str(shard_size),
                "--workers", variant.removeprefix("workers_")]
        code = cli(argv)
        assert code == 0, f"make-shards exited {code}"
        rows = json.loads((out / "index.json").read_text())["splits"]["train"]["num_samples"]
    wall, (m1, c1, f1) = time.perf_counter() - t0, _cpu()
    return {"rows": rows, "wall_s": wall, "cpu_s": (m1 - m0) + (c1 - c0), "main_cpu_s": m1 - m0,
            "main_page_faults": f1 - f0}


def _isolated(variant: str, folder: Path, out: Path, shard_size: int) -> dict:
    """run_variant in a fresh process (`python -m benchmarks.data.ingest --child ...`)."""
    cmd = [sys.executable, "-m", "benchmarks.data.ingest", "--child", variant, "--data", str(folder),
           "--shards-out", str(out), "--shard-size", str(shard_size)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("train-*.tar"))}


def write_dataset(folder: Path, rows: int, per_file: int, image_px: int) -> None:
    """Git-10M-shaped parquet files of ``per_file`` rows, without the planted faults (both sides
    must write every row)."""
    from tests.corpora import git10m_dataset, git10m_rows, jpeg

    (folder / "data").mkdir(parents=True)
    table = git10m_rows(rows)
    files = -(-rows // per_file)
    for k in range(files):
        lo, hi = k * per_file, min(rows, (k + 1) * per_file)
        block = {c: v[lo:hi] for c, v in table.items()}
        block["image"] = [{"bytes": jpeg(i, image_px), "path": None} for i in range(lo, hi)]
        block["caption"] = [c or "a road between fields" for c in block["caption"]]
        git10m_dataset(hi - lo, block).to_parquet(str(folder / "data" / f"train-{k:05d}-of-{files:05d}.parquet"))


def _spread(values: list[float], digits: int = 1) -> dict:
    return {"per_repeat": [round(v, digits) for v in values], "median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits)}


def _summary(runs: list[dict], small: list[dict], small_rows: int) -> dict:
    """A variant's repeats: whole-run rates, and the steady rate past start-up (the small run's
    CPU, mostly first-use imports and resolving the dataset, taken off: (N - n) / (CPU_N - CPU_n))."""
    steady = [(r["rows"] - small_rows) / (r["cpu_s"] - s["cpu_s"]) for r, s in zip(runs, small)]
    steady_main = [(r["rows"] - small_rows) / (r["main_cpu_s"] - s["main_cpu_s"]) for r, s in zip(runs, small)]
    return {"rows_per_cpu_s": _spread([r["rows"] / r["cpu_s"] for r in runs]),
            "rows_per_s_wall": _spread([r["rows"] / r["wall_s"] for r in runs]),
            "steady_rows_per_cpu_s": _spread(steady), "steady_main_rows_per_cpu_s": _spread(steady_main),
            "cpu_s": [round(r["cpu_s"], 4) for r in runs], "main_cpu_s": [round(r["main_cpu_s"], 4) for r in runs],
            "wall_s": [round(r["wall_s"], 3) for r in runs], "main_page_faults": [r["main_page_faults"] for r in runs],
            "startup_cpu_s": [round(s["cpu_s"], 4) for s in small]}


def measure(rows: int, repeats: int, shard_size: int, per_file: int, image_px: int, isolated: bool,
            small_rows: int) -> dict:
    """Every variant in alternation, ``repeats`` times, on ``rows`` rows and on ``small_rows``."""
    work = Path(tempfile.mkdtemp(prefix="ingest-bench-"))
    run = _isolated if isolated else run_variant
    try:
        folder, small = work / "git10m", work / "small"
        write_dataset(folder, rows, per_file, image_px)
        write_dataset(small, small_rows, per_file, image_px)
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        smalls: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for rep in range(repeats):   # alternate: load on the machine hits all alike
            digests = {}
            for variant in VARIANTS:
                out = work / f"{variant}-{rep}"
                smalls[variant].append(run(variant, small, work / f"{variant}-{rep}-small", shard_size))
                runs[variant].append(run(variant, folder, out, shard_size))
                assert runs[variant][-1]["rows"] == rows, (variant, runs[variant][-1]["rows"])
                digests[variant] = _digests(out)
                shutil.rmtree(out)
            assert digests["bare"] == digests["workers_1"] == digests["workers_2"], \
                "the bare loop and make-shards wrote different bytes: the ratio would compare unequal work"
            print(f"repeat {rep}: rows per CPU-second " + ", ".join(
                f"{v} {runs[v][-1]['rows'] / runs[v][-1]['cpu_s']:.0f}" for v in VARIANTS), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {v: _summary(runs[v], smalls[v], small_rows) for v in VARIANTS}
    for v in ("workers_1", "workers_2"):   # equal rows: the ratio of rates is bare's CPU / ours, per repeat
        results[v]["ratio_to_bare"] = _spread([b["cpu_s"] / o["cpu_s"] for o, b in zip(runs[v], runs["bare"])], 3)
        results[v]["steady_ratio_to_bare"] = _spread(
            [o / b for o, b in zip(results[v]["steady_rows_per_cpu_s"]["per_repeat"],
                                   results["bare"]["steady_rows_per_cpu_s"]["per_repeat"])], 3)
    return results


def projection(results: dict, cores: int = 32) -> dict:
    """Git-10M's wall time on ``cores`` cores at the steady rates (its start-up is seconds of an
    hour): the slower of the cores at the 2-worker rate per CPU-second and the one main process at
    its own CPU per row in that run."""
    w2 = results["workers_2"]
    per_core, main_rate = w2["steady_rows_per_cpu_s"]["median"], w2["steady_main_rows_per_cpu_s"]["median"]
    bound = min(per_core * cores, main_rate)
    return {"rows": GIT10M_ROWS, "cores": cores, "per_core_rows_per_cpu_s": per_core,
            "main_process_rows_per_cpu_s": main_rate, "cores_bound_rows_per_s": round(per_core * cores, 1),
            "bound_by": "main process" if main_rate < per_core * cores else "cores",
            "hours": round(GIT10M_ROWS / bound / 3600, 2),
            "note": "one process reads the parquet, checks the image headers and writes every tar; the workers "
                    "build the samples' captions, JSON and tar headers (and decode or re-encode when asked), so "
                    "more workers do not lift that bound; disk bandwidth assumed sufficient"}


def _child(args) -> int:
    run = run_variant(args.child, Path(args.data), Path(args.shards_out), args.shard_size)
    print(json.dumps(run))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = base_parser(__doc__, tiny=True, out=Path("benchmarks/results/ingest.json"))
    parser.add_argument("--rows", type=int, default=12000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-size", type=int, default=1000, help="make-shards' default")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)   # one variant, in this process
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--shards-out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return _child(args)
    rows, repeats, shard_size, per_file = (240, 1, 40, 100) if args.tiny else (args.rows, args.repeats,
                                                                              args.shard_size, 1500)
    cores = len(os.sched_getaffinity(0))
    results = measure(rows, repeats, shard_size, per_file, 64 if args.tiny else 256, isolated=not args.tiny,
                      small_rows=40 if args.tiny else 256)
    report = {"benchmark": "ingest", "tiny": args.tiny, "rows": rows, "repeats": repeats, "shard_size": shard_size,
              "rows_per_file": per_file, "bytes_identical": True, "target_ratio": TARGET,
              "unit": "rows per CPU-second of the variant's process and its workers (user + system)",
              "isolated_processes": not args.tiny, "results": results,
              "small_rows": 40 if args.tiny else 256,
              "pass": all(results[v]["ratio_to_bare"]["median"] >= TARGET for v in ("workers_1", "workers_2")),
              "git10m_projection": projection(results), "environment": environment(1, cores_available=cores)}

    def tables(r: dict) -> None:
        for name, row in r["results"].items():
            ratio, steady = row.get("ratio_to_bare", {"median": 1.0}), row.get("steady_ratio_to_bare", {"median": 1.0})
            print(f"{name:10s} {row['rows_per_cpu_s']['median']:9.1f} rows per CPU-second (median), ratio "
                  f"{ratio['median']:.3f}; past start-up {row['steady_rows_per_cpu_s']['median']:9.1f}, ratio "
                  f"{steady['median']:.3f}")
        p = r["git10m_projection"]
        print(f"Git-10M on 32 cores: ~{p['hours']} h (bound by the {p['bound_by']})")

    write_report(report, args.out, tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
