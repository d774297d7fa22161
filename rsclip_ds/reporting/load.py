"""Per-rank load: step time, data wait and peak memory per log window, and the data-wait warning.

Each rank measures its own window (the optimizer steps since the last log line) on the host
clock; the loop folds the three numbers into the sync point's one all-reduce (train._sync), so
measuring adds no collective and no host sync. What the numbers mean under synchronous data
parallelism (docs/guides/monitoring.md): every step ends in a gradient reduction that all ranks wait
at, so the ranks' step times agree to within noise, and a rank whose loader is slow shows up as
its own high data-wait fraction, the others waiting for it inside the step's collectives.
"""

from __future__ import annotations

import logging
import resource
import statistics
import sys
import time
from typing import Any, Iterator, Sequence

import torch

log = logging.getLogger("rsclip_ds")
# what peak_memory measures, as metrics.jsonl and the summary label it
CUDA_PEAK, HOST_PEAK = "cuda_max_memory_allocated", "host_rss_high_water"


def peak_memory(device: torch.device | str) -> tuple[int, str]:
    """-> (bytes, kind). On a GPU the caching allocator's peak of this process's device; on CPU
    ranks the process's resident-set high-water mark (getrusage; loader workers are other
    processes and not counted), which also holds the Python heap and libraries, not tensors only."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), CUDA_PEAK
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), HOST_PEAK   # Linux: KiB, macOS: bytes


class TimedBatches:
    """Wraps the batch iterator; `wait_s` adds up the seconds spent blocked in next()."""

    def __init__(self, batches: Iterator[dict]):
        self._it, self.wait_s = iter(batches), 0.0

    def __iter__(self) -> "TimedBatches":
        return self

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        try:
            return next(self._it)
        finally:
            self.wait_s += time.perf_counter() - t0


class LoadWindow:
    """This rank's seconds, data-wait seconds and peak memory since `reset()`; `paused` seconds
    (checkpoint saves, hooks) are left out, as they are from samples/s.

    On a GPU the host clock runs ahead of queued kernels between syncs; the window ends at a
    sync point, so at most the kernels queued behind its last step are missing."""

    def __init__(self, batches: TimedBatches, device: torch.device | str):
        self.batches, self.device = batches, device
        self.reset(0.0)

    def reset(self, paused: float) -> None:
        self._t0, self._paused0, self._wait0 = time.perf_counter(), paused, self.batches.wait_s

    def values(self, paused: float) -> list[float]:
        """[seconds, wait seconds, peak bytes]: what this rank contributes to the all-reduce."""
        seconds = time.perf_counter() - self._t0 - (paused - self._paused0)
        return [seconds, self.batches.wait_s - self._wait0, float(peak_memory(self.device)[0])]


def rank_record(per_rank: Sequence[Sequence[float]], steps: int, kind: str) -> dict[str, Any]:
    """Gathered [seconds, wait, peak] per rank over `steps` optimizer steps -> the per-rank
    lists of a metrics.jsonl line."""
    return {"step_s": [s / steps for s, _, _ in per_rank],
            "data_wait": [w / s if s > 0 else 0.0 for s, w, _ in per_rank],
            "peak_mem_bytes": [int(p) for _, _, p in per_rank], "peak_mem_kind": kind}


def add_to_totals(totals: dict[str, Any], per_rank: Sequence[Sequence[float]], steps: int, kind: str) -> dict:
    """Run totals for the summary (TrainResult.rank_load); a resume on another world size
    starts them again."""
    if len(totals.get("seconds", ())) != len(per_rank):
        totals = {"steps": 0, "seconds": [0.0] * len(per_rank), "wait_s": [0.0] * len(per_rank),
                  "peak_mem_bytes": [0] * len(per_rank), "peak_mem_kind": kind}
    totals["steps"] += steps
    for r, (s, w, p) in enumerate(per_rank):
        totals["seconds"][r] += s
        totals["wait_s"][r] += w
        totals["peak_mem_bytes"][r] = max(totals["peak_mem_bytes"][r], int(p))
    return totals


def load_summary(totals: dict[str, Any]) -> dict[str, Any] | None:
    """Run totals -> per-rank means and the named ranks: slowest / fastest (mean step time),
    max data wait, max peak memory. None before the first log line."""
    if not totals or not totals.get("steps"):
        return None
    steps, seconds, wait = totals["steps"], totals["seconds"], totals["wait_s"]
    step_s = [s / steps for s in seconds]
    data_wait = [w / s if s > 0 else 0.0 for s, w in zip(seconds, wait)]
    peak = totals["peak_mem_bytes"]
    ranks = range(len(step_s))
    return {"step_s": step_s, "data_wait": data_wait, "peak_mem_bytes": peak,
            "peak_mem_kind": totals["peak_mem_kind"],
            "slowest_rank": max(ranks, key=step_s.__getitem__), "fastest_rank": min(ranks, key=step_s.__getitem__),
            "max_data_wait_rank": max(ranks, key=data_wait.__getitem__),
            "max_peak_mem_rank": max(ranks, key=peak.__getitem__)}


def data_wait_outliers(fractions: Sequence[float], min_fraction: float, ratio: float) -> list[int]:
    """Ranks whose data-wait fraction is above `min_fraction` AND above `ratio` x the median of
    the OTHER ranks' fractions (the median of all ranks would hide one slow rank of two: with
    f1 > 3 x mean(f0, f1) impossible). One rank alone is never an outlier."""
    out = []
    for r, f in enumerate(fractions):
        others = [x for i, x in enumerate(fractions) if i != r]
        if others and f > min_fraction and f > ratio * statistics.median(others):
            out.append(r)
    return out


class DataWaitWatch:
    """Warns (rank 0's log) when a rank becomes a data-wait outlier, once per occurrence: not
    again while it stays one, again after it has recovered (an info line says so)."""

    def __init__(self, min_fraction: float = 0.2, ratio: float = 3.0):
        self.min_fraction, self.ratio = min_fraction, ratio
        self.flagged: set[int] = set()

    def update(self, step: int, fractions: Sequence[float]) -> list[int]:
        """-> the ranks newly warned about at this step."""
        now = set(data_wait_outliers(fractions, self.min_fraction, self.ratio))
        new = sorted(now - self.flagged)
        for r in new:
            others = [x for i, x in enumerate(fractions) if i != r]
            log.warning("step %d: rank %d waits for data %.0f%% of its step time, the other ranks %.0f%% "
                        "(median): its loader is the bottleneck (threshold: > %.0f%% and > %.1fx the others; "
                        "logging.data_wait_warn_fraction / _ratio). Check that node's disk / network and "
                        "data.num_workers", step, r, 100 * fractions[r], 100 * statistics.median(others),
                        100 * self.min_fraction, self.ratio)
        for r in sorted(self.flagged - now):
            log.info("step %d: rank %d's data wait is back to %.0f%%", step, r, 100 * fractions[r])
        self.flagged = now
        return new
