"""What every benchmark script repeats, so that each script holds only what it measures:
arguments (--out, --threads, the launcher's --local_rank), the process group, the environment
record, the max over ranks, the rank-0 report (JSON + PNG + the results page's tables), synthetic
shards, and a sub-run in a fresh process.

The scripts run as modules from the repository root (`python -m benchmarks.memory.per_rank`,
`deepspeed --module benchmarks.comms.traffic`), so they import this as `benchmarks.harness` and
each other by their dotted names.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rsclip_ds.runtime.distributed import DistInfo, destroy_distributed, init_distributed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# --------------------------------------------------------------------------- arguments

def base_parser(doc: str, *, out: Path | None = None) -> argparse.ArgumentParser:
    """--out (required unless `out` gives a default), --threads and the --local_rank the deepspeed
    launcher appends."""
    parser = argparse.ArgumentParser(description=doc.strip().split("\n")[0])
    parser.add_argument("--out", type=Path, required=out is None, default=out,
                        help="JSON path; a PNG goes beside it where the script draws one")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (2 ranks on 2 cores: 1, no oversubscription)")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser


# --------------------------------------------------------------------------- process group

@contextmanager
def process_group(threads: int) -> Iterator[DistInfo]:
    """The benchmark process's group (a one-rank group on localhost without a launcher), torch
    threads pinned, DeepSpeed and transformers quiet. Trainers built inside leave it alone."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # With torch's default (all cores per rank) 2 ranks on 2 cores oversubscribe: on a busy
    # machine a tiny step went from 20 ms to 1 s (OpenMP waits). accelerate (the HF Trainer)
    # sets torch's threads from OMP_NUM_THREADS when it is unset: pin both.
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    info = init_distributed()
    try:
        yield info
    finally:
        destroy_distributed()


def rank0_print(rank: int) -> Callable[[str], None]:
    """print on rank 0 (rich, no markup: paths and brackets print as they are), nothing elsewhere."""
    if rank != 0:
        return lambda msg: None
    from rich.console import Console

    return Console(soft_wrap=True, markup=False).print


def environment(threads: int, **extra) -> dict:
    """Versions, device and ranks; the DeepSpeed fields when a process group runs."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
           "threads_per_rank": threads}
    if dist.is_initialized():
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        env.update(deepspeed=deepspeed.__version__, world_size=dist.get_world_size(),
                   device=get_accelerator().device_name(), backend=dist.get_backend())
    return {**env, **extra}


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max over ranks (every rank gets it)."""
    # on the accelerator: a GPU run's process group is NCCL only, which has no CPU tensors
    from deepspeed.accelerator import get_accelerator

    t = torch.tensor(values, dtype=torch.float64, device=get_accelerator().current_device_name())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


# --------------------------------------------------------------------------- report

def write_report(report: dict, out: Path, print_tables: Callable[[dict], None],
                 plot: Callable[[dict, Path], str | None] | None = None) -> None:
    """The PNG beside the JSON (plot returns its path, or None without matplotlib), the JSON
    itself, then the tables. Call on rank 0 only."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if plot is not None:
        report["png"] = plot(report, out.with_suffix(".png"))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_tables(report)


def page_tables(tables: Callable[[dict[str, dict]], list[str]], name: str) -> Callable[[dict], None]:
    """The print_tables of write_report / finish: the tables the results page shows for a file called
    `name` (its section's function in benchmarks/results_tables/), as markdown, so that the terminal
    and docs/results/ say the same."""
    return lambda report: print("\n".join(tables({name: report})))


def finish(report: dict, out: Path, rank: int, print_tables: Callable[[dict], None],
           plot: Callable[[dict, Path], str | None] | None = None) -> None:
    """Rank 0 writes the report; every rank waits for it (no rank tears down the group early)."""
    if rank == 0:
        write_report(report, out, print_tables, plot)
    if dist.is_initialized():
        dist.barrier()


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None with a note (it is an optional extra)."""
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed (pip install rsclip_ds[bench]); wrote the JSON only")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# --------------------------------------------------------------------------- data

def synthetic_data(root: Path, *, num_train: int, num_val: int, shard_size: int, image_size: int = 64) -> dict:
    """Synthetic shards of `image_size` px JPEGs and a tokenizer trained on their captions, written
    once per size (reused when present) -> {"train_pattern", "val_urls", "tokenizer"}."""
    from rsclip_ds.data.synthetic import make_synthetic
    from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer

    px = "" if image_size == 64 else f"_{image_size}px"   # 64 px: the folders earlier versions wrote
    folder = Path(root) / f"synthetic_{num_train}_{num_val}_{shard_size}{px}"
    if not (folder / "tokenizer" / "tokenizer.json").is_file():
        index = make_synthetic(folder, num_train=num_train, num_val=num_val, shard_size=shard_size,
                               image_size=image_size, seed=0, progress=False)
        urls = [str(folder / s["url"]) for s in index["train"]]
        train_tokenizer(iter_captions(urls), folder / "tokenizer", vocab_size=500, max_length=64)
    n_train, n_val = -(-num_train // shard_size), -(-num_val // shard_size)
    return {"train_pattern": str(folder / f"train-{{000000..{n_train - 1:06d}}}.tar"),
            "val_urls": [str(folder / f"val-{i:06d}.tar") for i in range(n_val)],
            "tokenizer": str(folder / "tokenizer")}


# --------------------------------------------------------------------------- sub-runs

def run_script(module: str, args: list[str], result: Path, timeout: float) -> dict:
    """`python -m module args` in a fresh process with no launcher variables (it makes its own
    one-rank group), this checkout on PYTHONPATH -> the JSON it wrote to `result`, or
    {"ok": False, "error": ...} when it failed, wrote nothing or ran out of time."""
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_PORT"):
        environ.pop(key, None)
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], env=environ, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f}s"}
    if proc.returncode != 0 or not result.is_file():
        return {"ok": False, "error": f"exit {proc.returncode}",
                "output_tail": (proc.stdout + proc.stderr).strip().splitlines()[-15:]}
    return json.loads(result.read_text())


def deepspeed_cmd() -> list[str]:
    exe = shutil.which("deepspeed")
    return [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
