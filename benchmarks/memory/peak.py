"""The peak memory of one rank over an optimizer step, measured for benchmarks/memory/per_rank.py and
compared with `rsclip_ds.planning.memory.peak` (the fit decision of `rsclip-ds plan` uses the peak).

On a GPU: `torch.cuda.max_memory_allocated` over the second optimizer step (peak stats reset
before it) against `Peak.allocated`, and `max_memory_reserved` reported beside it.

On CPU ranks the accelerator's memory and the host's are one: the peak is the process's resident
set. Linux's VmHWM (high-water mark of the resident set) is reset through /proc/self/clear_refs
before the second optimizer step and read after it; the measured peak is that minus the resident
set before the profile's model was built (libraries, Python, the process group: not the run's).
glibc is told to serve every block of 1 MiB or more with its own mapping and to give freed memory
back at once (`mallopt`), so that the resident set follows the live tensors instead of what the
allocator kept; without that a freed gradient bucket stays resident and the next profile's peak
starts from it (the 9 GiB "ZeRO-3 peak" an earlier version reported, measuring all profiles in
one process with `ru_maxrss`, was mostly that). Compared against `Peak.host` with
`device="cpu"` (offloaded states included, untouched pages of a bucket excluded, no CUDA reserve).
Why the second step: ZeRO-1/2 create Adam's m and v in the first step, ZeRO-3 traces the module
order in the first and prefetches from the second on.
"""

from __future__ import annotations

import ctypes
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rsclip_ds.engine import engine_dtype
from rsclip_ds.loop import micro_batch_step

MMAP_THRESHOLD, TRIM_THRESHOLD = -3, -1   # glibc mallopt parameters (malloc.h)


def tune_host_allocator() -> bool:
    """Blocks >= 1 MiB get their own mappings, returned at free: the resident set then tracks
    the live tensors. Call before anything large is allocated; False where glibc is absent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(MMAP_THRESHOLD, 1 << 20)) and bool(libc.mallopt(TRIM_THRESHOLD, 1 << 20))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def resident_bytes() -> int:
    """The resident set now, after freeing what can be freed."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return _status("VmRSS")


def reset_high_water_mark() -> None:
    Path("/proc/self/clear_refs").write_text("5")   # resets VmHWM to the current VmRSS


def measured_peak(engine, batches, loss_fn, accumulation: int, on_gpu: bool, base: int) -> dict:
    """Two optimizer steps of `accumulation` micro-steps each; the second one measured."""
    dtype = engine_dtype(engine)
    for _ in range(accumulation):                  # first step: optimizer state, ZeRO-3's trace
        micro_batch_step(engine, next(batches), loss_fn, dtype)
    batch = [next(batches) for _ in range(accumulation)]
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_high_water_mark()
    dist.barrier()
    t0 = time.perf_counter()
    for b in batch:
        micro_batch_step(engine, b, loss_fn, dtype)
    seconds = time.perf_counter() - t0
    if on_gpu:
        torch.cuda.synchronize()
        return {"peak": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                "seconds": seconds}
    return {"peak": _status("VmHWM") - base, "reserved": None, "seconds": seconds}
