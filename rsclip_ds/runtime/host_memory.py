"""Host memory of CPU ranks: keep freed blocks for reuse instead of returning them to the kernel.

On a GPU the CUDA caching allocator keeps freed device memory for the next step. On CPU ranks
tensors come from glibc's malloc, which serves every block above its mmap threshold (at most
32 MiB) with a fresh `mmap` and unmaps it on free, and trims the heap's free top. DeepSpeed
allocates whole buffers per step (ZeRO-1/2's reduce buckets of `reduce_bucket_size` elements,
the flattened gradient partition, all-gather outputs on gloo's worker thread), so each step the
kernel zero-fills the same hundreds of MB again: measured on the 20M-parameter model of
benchmarks/throughput/openclip.py, ZeRO-2 fp32, 2 ranks, 488 MB of minor page faults and
264 ms of kernel time per step per rank against 153 MB / 84 ms for DDP with torch's AdamW.
`keep_freed_memory` sets malloc to serve everything from one heap (no mmap, one arena for all
threads) and never trim it: 6-12 MB and ~60 ms per step. The resident set then stays at the
run's high-water mark, as GPU memory does under the caching allocator -- and, unlike that
allocator's, the mark creeps up: freed blocks fragment the one heap, so a step's buffers do not
always fit where the last step's were (issue 28, the same run: the process tree's PSS 2.9 GB at
step 5, 5.1 GB at step 50; 0.6 GB per rank flat without it, 1.0 -> 1.5-1.8 GB with it over 40
steps; per-thread arenas or 5M-element buckets grow as well, a malloc_trim every 10 steps costs
12% more CPU). `distributed.host_memory=release` (settings.py) leaves glibc's defaults.

Huge pages (`ask_for_huge_pages`): what that heap grows by was faulted in 4 KiB at a time (a
`rsclip-ds train` of the same model, zero2 fp32, 2 ranks: 11.6k minor faults per step per rank,
0.9-1.5k with huge pages). torch's CPU allocator advises the kernel to back every block of
2 MiB and more with transparent huge pages (`madvise(MADV_HUGEPAGE)`) when THP_MEM_ALLOC_ENABLE=1
is in the environment when it first allocates, i.e. before torch is imported: the entry points (rsclip_ds/__main__.py) set it for `rsclip-ds train` on CPU ranks,
unless it is set already (0 keeps it off). Measured in the open_clip comparison's users style
(benchmarks/throughput/openclip.py --style users; docs/benchmarks/throughput.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence

log = logging.getLogger("rsclip_ds")

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER_TRIM = 2**31 - 1   # mallopt takes an int: 2 GiB of free heap top is kept
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"   # c10's alloc_cpu reads it once, at its first allocation
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def thp_mode(path: str = THP_MODE) -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise or never), None where it has none."""
    try:
        text = open(path).read()
    except OSError:
        return None
    return next((word[1:-1] for word in text.split() if word.startswith("[")), None)


def _command(argv: Sequence[str]) -> str | None:
    """The sub-command in a command line, past the launcher's `--local_rank=N` / `--local_rank N`."""
    args = iter(argv)
    for arg in args:
        if arg in ("--local_rank", "--local-rank"):
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def ask_for_huge_pages(argv: Sequence[str], environ: MutableMapping[str, str] = os.environ,
                       mode: str | None = None) -> bool:
    """For `rsclip-ds train` on CPU ranks (DS_ACCELERATOR=cpu, as they are started): set
    THP_MEM_ALLOC_ENABLE=1, so that torch backs its CPU tensors of 2 MiB and more with transparent
    huge pages. Call before torch is imported. Nothing changes where the variable is set already
    (the user's value wins, 0 included), on another command or accelerator, or where the kernel
    has no THP (`mode`: thp_mode()'s, read when None). Returns whether it set the variable."""
    if _command(argv) != "train" or environ.get("DS_ACCELERATOR") != "cpu" or TORCH_HUGE_PAGES in environ:
        return False
    if (mode or thp_mode()) not in ("always", "madvise"):
        return False
    environ[TORCH_HUGE_PAGES] = "1"
    return True


def anon_huge_bytes(path: str = "/proc/self/smaps_rollup") -> int | None:
    """This process's anonymous memory in transparent huge pages (AnonHugePages), None unreadable."""
    try:
        for line in open(path):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_memory_state(setting: str, environ: MutableMapping[str, str] = os.environ) -> dict:
    """A CPU rank's host allocator as it is: the summary's `host_memory` and the start-up line."""
    value = environ.get(TORCH_HUGE_PAGES)
    return {"setting": setting, TORCH_HUGE_PAGES: value, "huge_pages": value not in (None, "", "0"),
            "thp_mode": thp_mode(), "anon_huge_pages_bytes": anon_huge_bytes()}


def host_memory_said(state: dict) -> str:
    kept = ("keep (glibc malloc: one heap, never trimmed)" if state["setting"] == "keep"
            else "release (glibc's defaults)")
    value = state[TORCH_HUGE_PAGES]
    huge = (f"huge pages for tensors of 2 MiB and more ({TORCH_HUGE_PAGES}={value}, kernel THP mode "
            f"{state['thp_mode']})" if state["huge_pages"] else
            f"no huge pages ({TORCH_HUGE_PAGES} {'unset' if value is None else '=' + value})")
    return f"{kept}; {huge}"
