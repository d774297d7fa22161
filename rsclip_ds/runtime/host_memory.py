"""Host memory of CPU ranks: keep freed blocks for reuse instead of returning them to the kernel.

On a GPU the CUDA caching allocator keeps freed device memory for the next step. On CPU ranks
tensors come from glibc's malloc, which serves every block above its mmap threshold (at most
32 MiB) with a fresh `mmap` and unmaps it on free, and trims the heap's free top. DeepSpeed
allocates whole buffers per step (ZeRO-1/2's reduce buckets of `reduce_bucket_size` elements,
the flattened gradient partition, all-gather outputs on gloo's worker thread), so each step the
kernel zero-fills the same hundreds of MB again: measured on the 20M-parameter model of
benchmarks/throughput/compare.py --open-clip, ZeRO-2 fp32, 2 ranks, 488 MB of minor page faults and
264 ms of kernel time per step per rank against 153 MB / 84 ms for DDP with torch's AdamW.
`keep_freed_memory` sets malloc to serve everything from one heap (no mmap, one arena for all
threads) and never trim it: 6-12 MB and ~60 ms per step. The resident set then stays at the
run's high-water mark, as GPU memory does under the caching allocator -- and, unlike that
allocator's, the mark creeps up: freed blocks fragment the one heap, so a step's buffers do not
always fit where the last step's were (issue 28, the same run: the process tree's PSS 2.9 GB at
step 5, 5.1 GB at step 50; 0.6 GB per rank flat without it, 1.0 -> 1.5-1.8 GB with it over 40
steps; per-thread arenas or 5M-element buckets grow as well, a malloc_trim every 10 steps costs
12% more CPU). `distributed.host_memory=release` (settings.py) leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("rsclip_ds")

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER_TRIM = 2**31 - 1   # mallopt takes an int: 2 GiB of free heap top is kept


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None   # musl has no mallopt
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Make glibc malloc keep freed memory in the process for reuse (see the module docstring).
    Call early, before threads allocate (gloo's workers get the one arena then); later calls
    change only later allocations. Returns False where it cannot (not glibc): nothing changes."""
    libc = _libc()
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in
             ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM)))
    if not ok:
        log.warning("could not set glibc malloc to keep freed memory; CPU ranks pay page faults each step")
    return ok
