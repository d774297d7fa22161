"""What every benchmark script shares: the environment record and the rank-0 report writer.
The scripts are run by path (`deepspeed ... benchmarks/X.py`), so this imports as `common`."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist


def environment(world: int, threads: int) -> dict:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "python": platform.python_version(),
            "world_size": world, "device": get_accelerator().device_name(), "backend": dist.get_backend(),
            "threads_per_rank": threads, "cpu_count": os.cpu_count()}


def write_report(report: dict, out: Path, plot: Callable[[dict, Path], str | None],
                 print_tables: Callable[[dict], None]) -> None:
    """Rank 0 only: the PNG beside the JSON (plot returns its path, or None without
    matplotlib), the JSON itself, then the tables."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report["png"] = plot(report, out.with_suffix(".png"))
    out.write_text(json.dumps(report, indent=2))
    print_tables(report)


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max over ranks, reduced on the accelerator: a GPU run's process group is
    NCCL, which has no CPU tensors."""
    from deepspeed.accelerator import get_accelerator

    t = torch.tensor(values, dtype=torch.float64, device=get_accelerator().current_device_name())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()
