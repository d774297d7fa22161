"""Storage every rank must agree on: the run's output folder, the checkpoint to resume, and
durable renames on file systems that cannot sync a folder.

A multi-node run writes its checkpoints into one folder that every node must see (rank 0 alone
writes the pointer and the meta file; every rank writes its shards there). With node-local
disks the other nodes could not resume, and on NFS two ranks could read the pointer at
different moments and resume different steps. So:

- `check_shared_dir` (start-up): rank 0 writes a probe file with a fresh name, every rank looks
  for it (a few seconds of retries for NFS attribute caches); when some rank cannot see it the
  run stops on every rank with a ConfigError naming the ranks, their hosts and the fix.
- `decide_on_rank0`: rank 0 computes a value (the tag to resume), every rank gets rank 0's
  value, or rank 0's ConfigError.
- `fsync_dir`: makes a rename durable; file systems that cannot fsync a folder (some FUSE and
  object-store mounts answer EINVAL or ENOTSUP) are tolerated with one log line.
- `gather_on_every_rank`: every rank's small value on every rank (one all_gather_object): how the
  ranks agree on the outcome of a save (a full disk on one rank) and of a verification.
- `free_bytes`, `mount_of`, `is_no_space`: the free space of a folder's file system, which
  file system that is, and whether an OSError means a full disk or quota (ENOSPC, EDQUOT).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Callable, TypeVar

import torch.distributed as dist

from rsclip_ds.config import ConfigError

log = logging.getLogger("rsclip_ds")
T = TypeVar("T")

PROBE = ".rsclip_shared_probe-{}"
# errno values meaning "this file system does not sync folders", not "the data is at risk"
_NO_DIR_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR}
_warned_no_dir_sync: set[str] = set()


def _group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def fsync_dir(path: Path) -> None:
    """fsync a folder (after a rename in it); a file system that does not support it is noted
    once per folder and tolerated: the rename has happened, only its durability across a power
    loss is the file system's business there."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _NO_DIR_SYNC:
            raise
        if str(path) not in _warned_no_dir_sync:
            _warned_no_dir_sync.add(str(path))
            log.info("%s: this file system cannot fsync a folder (%s); renames there are not synced",
                     path, errno.errorcode.get(err.errno, err.errno))
    finally:
        os.close(fd)


def decide_on_rank0(decide: Callable[[], T]) -> T:
    """Rank 0's ``decide()`` on every rank (one broadcast); a ConfigError raised by rank 0 is
    raised on every rank, with its message. Without a process group: ``decide()``."""
    if not _group():
        return decide()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("value", decide())
        except ConfigError as err:
            box[0] = ("error", str(err))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise ConfigError(value)
    return value


def gather_on_every_rank(value: T) -> list[T]:
    """[rank 0's value, rank 1's, ...] on every rank (one all_gather_object; values must pickle);
    without a process group: [value]. Every rank of the group must call it."""
    if not _group():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# errno values of a write that found no room: the disk is full, or the user's quota is
NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


def is_no_space(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in NO_SPACE


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (a folder not made yet lives on its parent's disk)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding ``path``."""
    return shutil.disk_usage(_existing(path)).free


def mount_of(path: Path) -> str:
    """'DEVICE mounted at MOUNTPOINT' for the file system holding ``path`` (from /proc/self/mounts:
    the longest mount point above it), or the path itself where the mount table cannot be read."""
    real = os.path.realpath(_existing(path))
    best = ("", "")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                device, point = line.split()[:2]
                point = point.replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[1]):
                    best = (device, point)
    except OSError:
        pass
    return f"{best[0]} mounted at {best[1]}" if best[1] else real


def check_shared_dir(path: Path, wait_s: float = 10.0) -> None:
    """Every rank of the group must see the files rank 0 writes under ``path`` (created if
    missing). Raises ConfigError on every rank otherwise."""
    if not _group():
        return
    path = Path(path)
    rank = dist.get_rank()
    name = decide_on_rank0(lambda: PROBE.format(uuid.uuid4().hex))
    probe = path / name
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text(socket.gethostname())
    dist.barrier()
    deadline = time.monotonic() + wait_s
    seen = probe.is_file()
    while not seen and time.monotonic() < deadline:   # NFS: a fresh name may take a moment to appear
        time.sleep(0.5)
        seen = probe.is_file()
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [(r, host) for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        hosts = sorted({host for _, host in blind})
        raise ConfigError(
            f"output_dir {path} is not shared by every rank: rank(s) {', '.join(str(r) for r, _ in blind)} on "
            f"{', '.join(hosts)} do not see the file rank 0 (on {views[0][1]}) wrote there. Checkpoints and "
            f"resumes need one folder every node sees at the same path: put output_dir on a shared file "
            f"system (NFS, Lustre, GPFS, ...) mounted on every node, e.g. --set output_dir=/shared/runs/NAME")
