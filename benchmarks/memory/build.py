"""Host memory of building a ZeRO-3 run, per rank: the model built whole (`preset_bundle` without
the DeepSpeed config: each rank first holds the full fp32 model, 4Ψ bytes, which the engine then
partitions; what runs do for presets) against built inside deepspeed.zero.Init
(`preset_bundle(..., ds_config=)`; what `Trainer` does for a pretrained model under ZeRO-3: each
rank holds only its partition from the start). The
`--build-rss` mode of memory.py:

    DS_ACCELERATOR=cpu python -m benchmarks.memory.per_rank --build-rss --out benchmarks/results/build_rss.json

git-rsclip-base, profile zero3, 2 CPU ranks; 4-6 minutes on 2 cores. VmHWM is a per-process
high-water mark, so every variant runs in its own launch (`deepspeed --num_gpus 2 memory.py
--build-rss-worker ...`, started by this driver, which is a plain `python`): precision (bf16,
fp32) x allocator (glibc's default; MALLOC_MMAP_THRESHOLD_=131072 in the ranks' environment) x
build (whole; zero.Init) = 8 launches. `--preset tiny --precision fp32 --mmap-threshold default`
is the test's seconds-long variant.

Each rank reads, after the process group started (`start`: imports, gloo), after the model
build (`model`) and after the engine build (`engine`: `Trainer(run, model=, loader=).build()`,
optimizer states included):
  hwm          VmHWM of /proc/self/status: the process's peak resident memory so far (what a
               cgroup limit or the OOM killer meets)
  rss          VmRSS: resident now; rss_anon / rss_file / rss_shmem its parts (the libraries'
               code is file-backed, DeepSpeed's CPU all-reduce buffer shared memory)
  malloc_free  glibc's mallinfo2().fordblks: bytes the program freed that malloc keeps in its
               heaps for later allocations; an upper bound of what rss counts of them (pages of
               a free chunk that were never touched, or were given back, are not resident)
  params_held  bytes of the parameters' storages on this rank: p.data where it is not empty and
               the ZeRO-3 partition p.ds_tensor, each storage once (`memory_counting.Ledger`)
  seconds      time of the stage
and last (`trimmed`) VmRSS and its parts once glibc's malloc_trim(0) returned its heaps' free
pages to the OS: what the rank holds after the engine build, without what malloc kept.
Why two allocators: zero.Init builds each module's parameters at full size, then keeps 1/W and
frees the rest. glibc serves blocks above its mmap threshold with mmap (returned to the OS on
free), but the threshold is dynamic: freeing an mmapped block raises it to that block's size (up
to 32 MiB), so the next blocks of that size come from the heap, and freed heap blocks below its
top stay resident. RSS then overstates what the rank holds; MALLOC_MMAP_THRESHOLD_ fixes the
threshold (128 KiB here), which turns the dynamic raise off.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from benchmarks.harness import environment, process_group, run_script, write_report
from benchmarks.memory.counting import Ledger

PROFILE = "zero3"
STAGES = ("start", "model", "engine", "trimmed")
THRESHOLD_VAR = "MALLOC_MMAP_THRESHOLD_"
STATUS = {"VmHWM": "hwm", "VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--build-rss", action="store_true",
                        help="host memory of building a ZeRO-3 run per rank, model built whole vs inside "
                             "zero.Init (benchmarks/memory/build.py; run with python: it launches its own ranks)")
    parser.add_argument("--mmap-threshold", nargs="+", default=["default", "131072"],
                        help="--build-rss: glibc allocators to run, 'default' or a MALLOC_MMAP_THRESHOLD_ in bytes")
    parser.add_argument("--ranks", type=int, default=2, help="--build-rss: ranks per launch")
    parser.add_argument("--case-timeout", type=float, default=300.0, help="--build-rss: seconds per launch")
    parser.add_argument("--build-rss-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--zero-init", choices=("on", "off"), default="on", help=argparse.SUPPRESS)


# --------------------------------------------------------------------------- one variant (ranks)

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_free_bytes() -> int | None:
    """Freed bytes glibc keeps in its heaps (all arenas); None without glibc's mallinfo2 (2.33+)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().fordblks)


def proc_status() -> dict[str, int]:
    """VmHWM, VmRSS and its parts (anonymous, file-backed: the libraries' code, shared memory:
    DeepSpeed's all-reduce buffer) of this process, in bytes (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS:
                out[STATUS[key]] = int(value.split()[0]) * 1024   # kB
    return out


def held_param_bytes(model) -> int:
    ledger = Ledger()
    ledger.add("params", "here", [t for p in model.parameters() for t in (p.data, getattr(p, "ds_tensor", None))])
    return ledger.get("params")


def reading(model=None, since: float | None = None) -> dict:
    gc.collect()   # a garbage cycle is not held
    row = {**proc_status(), "malloc_free": malloc_free_bytes()}
    if model is not None:
        row["params_held"] = held_param_bytes(model)
    if since is not None:
        row["seconds"] = time.perf_counter() - since
    return row


def trimmed() -> dict:
    """VmRSS after glibc's malloc_trim(0) gave the free pages of its heaps back to the OS: what the
    rank holds, without what the allocator kept. Taken last: it changes what a later reading sees."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc_trim(0)
    return {k: v for k, v in proc_status().items() if k != "hwm"}


def max_over(per_rank: list[dict]) -> dict:
    """{stage: {key: the largest rank's value}}; None (no mallinfo2) stays None."""
    return {stage: {key: None if per_rank[0][stage][key] is None else max(r[stage][key] for r in per_rank)
                    for key in per_rank[0][stage]} for stage in STAGES}


def measure(args) -> dict:
    """On every rank: the readings of one variant (`--zero-init`, the allocator the environment
    set); rank 0 writes every rank's."""
    # imported before "start" (preset_bundle imports them lazily): the model stage then counts
    # the model, not ~0.1 GiB of modeling code
    import transformers.integrations.deepspeed  # noqa: F401
    from transformers import SiglipModel  # noqa: F401

    from rsclip_ds.config import load_config
    from rsclip_ds.model import preset_bundle
    from rsclip_ds.trainer import Trainer, check_run

    with process_group(args.threads) as info, tempfile.TemporaryDirectory() as out_dir:
        readings = {"start": reading()}
        run = load_config(None, [f"profile={PROFILE}", f"precision={args.precision[0]}", f"model.preset={args.preset}",
                                 "batch.micro_batch_size=1", "steps=1", "optim.warmup_steps=0",
                                 f"output_dir={out_dir}", "checkpoint.at_end=false"])
        _, ds_config = check_run(run, shards=False)
        t0 = time.perf_counter()
        # No tokenizer: no batch is read and nothing Trainer.build runs here reads one (our
        # loader, no evaluation, no checkpoint saved: write_hf_extras would need it).
        bundle = preset_bundle(args.preset, None, run.seed, ds_config=ds_config if args.zero_init == "on" else None,
                               own_vocabulary=True)
        readings["model"] = reading(bundle.model, t0)
        with Trainer(run, model=bundle, loader=()) as trainer:   # no step is taken: an empty loader
            t0 = time.perf_counter()
            trainer.build()
            readings["engine"] = reading(bundle.model, t0)
            readings["trimmed"] = trimmed()
        per_rank = [None] * info.world_size
        dist.all_gather_object(per_rank, readings)
        threshold = os.environ.get(THRESHOLD_VAR)
        report = {"ok": True, "preset": args.preset, "profile": PROFILE, "precision": args.precision[0],
                  "build": "zero.Init" if args.zero_init == "on" else "whole",
                  "allocator": f"{THRESHOLD_VAR}={threshold}" if threshold else "default",
                  "parameters": bundle.num_parameters(), "world_size": info.world_size, "ranks": per_rank,
                  "max_over_ranks": max_over(per_rank), "environment": environment(args.threads)}
        if info.rank == 0:
            args.out.write_text(json.dumps(report, indent=2))
        dist.barrier()
    return report


# --------------------------------------------------------------------------- driver

def variants(args) -> list[tuple[str, str, bool]]:
    """(precision, mmap threshold, zero.Init); before and after side by side."""
    return [(p, t, z) for p in args.precision for t in args.mmap_threshold for z in (False, True)]


def drive(args) -> int:
    if "RANK" in os.environ:
        sys.exit("--build-rss launches its own ranks (one launch per variant): run it with python, not under "
                 "deepspeed: DS_ACCELERATOR=cpu python --module benchmarks.memory.per_rank --build-rss --out ...")
    t0, rows = time.perf_counter(), []
    for precision, threshold, zero_init in variants(args):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "variant.json"
            cli = ["--build-rss-worker", "--zero-init", "on" if zero_init else "off", "--preset", args.preset,
                   "--precision", precision, "--threads", str(args.threads), "--out", str(result)]
            row = run_script("benchmarks.memory.per_rank", cli, result, args.case_timeout, ranks=args.ranks,
                             env={THRESHOLD_VAR: None if threshold == "default" else threshold})
        rows.append({"precision": precision, "build": "zero.Init" if zero_init else "whole",
                     "mmap_threshold": threshold, **row})
        done = f"model-build VmHWM {row['max_over_ranks']['model']['hwm'] / 2**30:.3f} GiB" if row["ok"] \
            else row["error"]
        print(f"[{len(rows)}/{len(variants(args))}] {precision} {threshold} {rows[-1]['build']}: {done} "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
    report = {"config": {"preset": args.preset, "profile": PROFILE, "ranks": args.ranks, "precisions": args.precision,
                         "mmap_thresholds": args.mmap_threshold},
              "environment": environment(args.threads), "variants": rows, "seconds": time.perf_counter() - t0}
    write_report(report, args.out, print_table)
    print(f"wrote {args.out} in {report['seconds']:.0f}s")
    return 0 if all(r["ok"] for r in rows) else 1


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    table = Table(title=f"{cfg['preset']} {cfg['profile']}, {cfg['ranks']} ranks: host memory per rank, MiB "
                        "(max over ranks)")
    for col in ("precision", "allocator", "build", "start HWM", "model HWM", "model RSS", "heap free",
                "params held", "engine HWM", "engine RSS", "params held", "trimmed RSS", "build s"):
        table.add_column(col, justify="right")
    mib = (lambda b: f"{b / 2**20:.1f}" if b is not None else "-")
    for r in report["variants"]:
        head = (r["precision"], r["mmap_threshold"], r["build"])
        if not r["ok"]:
            table.add_row(*head, r["error"], *[""] * 9)
            continue
        m = r["max_over_ranks"]
        table.add_row(*head, mib(m["start"]["hwm"]), mib(m["model"]["hwm"]), mib(m["model"]["rss"]),
                      mib(m["model"]["malloc_free"]), mib(m["model"]["params_held"]), mib(m["engine"]["hwm"]),
                      mib(m["engine"]["rss"]), mib(m["engine"]["params_held"]), mib(m["trimmed"]["rss"]),
                      f"{m['model']['seconds']:.0f} + {m['engine']['seconds']:.0f}")
    Console(width=200).print(table)


def main(args) -> int:
    if args.build_rss_worker:
        measure(args)
        return 0
    return drive(args)
