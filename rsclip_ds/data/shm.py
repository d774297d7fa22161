"""/dev/shm, through which DataLoader workers hand their batches to the rank: what the loaders of
a node hold there at most, and the start-up check against the free space (a worker that cannot
grow its batch there dies of SIGBUS mid-run)."""

from __future__ import annotations

import math
import os
import shutil
from typing import Any, Callable

from rsclip_ds.config import ConfigError

PREFETCH_FACTOR = 2   # batches each DataLoader worker has in flight

SHM_MARGIN = 1.25   # token-id pickles, allocator rounding, the collective library's own segments


def shared_memory_need(batch_bytes: int, workers: int, held: int, local_ranks: int) -> int:
    """/dev/shm bytes the loaders of one node hold at most:
        local_ranks x ceil(1.25 x batch_bytes x (PREFETCH_FACTOR x workers + held)),
    per rank the batches its workers have in flight plus the ``held`` ones its train step keeps
    (a step takes all its accumulation steps' micro-batches before it starts). 0 without
    workers: batches are then made in the rank's own process, in ordinary memory."""
    if workers == 0:
        return 0
    return local_ranks * math.ceil(SHM_MARGIN * batch_bytes * (PREFETCH_FACTOR * workers + held))


def _free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def check_shared_memory(loader: Any, *, held: int, local_ranks: int, path: str = "/dev/shm",
                        free_bytes: Callable[[str], int] = _free_bytes) -> int:
    """Raise ConfigError, naming the fixes, when ``path`` has less room than the loaders of this
    node need (shared_memory_need; ``loader``: a loader.TrainLoader): a worker that cannot grow
    its batch there dies of SIGBUS mid-run (Docker's default /dev/shm is 64 MB). -> the bytes needed. No check where ``path``
    does not exist (not Linux)."""
    need = shared_memory_need(loader.batch_bytes, loader.num_workers, held, local_ranks)
    if need == 0 or not os.path.isdir(path):
        return need
    free = free_bytes(path)
    if free >= need:
        return need
    mib, size = 2 ** 20, loader.prep.transform.size
    per_rank = SHM_MARGIN * loader.batch_bytes * local_ranks
    fits = math.floor((free / per_rank - held) / PREFETCH_FACTOR)   # workers that would fit
    raise ConfigError(
        f"the data loader needs ~{need / mib:.0f} MiB of shared memory on this node, {path} has "
        f"{free / mib:.0f} MiB free: {local_ranks} rank(s) x ({loader.num_workers} worker(s) x "
        f"{PREFETCH_FACTOR} batches in flight + {held} held by the step) x {loader.batch_bytes / mib:.1f} MiB "
        f"(micro batch {loader.collate.micro} at {size} px, uint8) x {SHM_MARGIN} margin. Fix one of: give "
        f"the container more (docker run --shm-size={max(1, math.ceil(need / 2 ** 30))}g ...; Kubernetes: an "
        f"emptyDir with medium: Memory mounted at /dev/shm); "
        + (f"--set data.num_workers={fits} (fits); " if fits >= 1 else "")
        + "a smaller batch.micro_batch_size; or --set data.num_workers=0 (no shared memory: batches are "
        "made in each rank's own process, slower)")
